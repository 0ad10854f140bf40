"""What one trainer step's numbers are, read where the trainer hands them on (tests/test_temperature.py and
tests/test_fixed_advantage.py, on the HF backend in process and on Megatron under torchrun, tests/step_worker.py): the
behaviour policy's logprobs (the engine's), the student's old ones, the teacher's and the loss's, as the largest gap
of each from the old ones over the response tokens; and the entropy and advantages an objective prepared from."""

from __future__ import annotations


def _gap(a, b, mask) -> float:
    return float((a - b).detach().abs()[mask.bool()].max())


def step_gaps(trainer) -> dict:
    """Runs one RL step of `trainer` and returns the largest |x - old logprob| over response tokens for x = the
    engine's logprob (``behaviour``), the teacher's where there is one (``teacher``: a teacher that is the student
    gives 0 at one temperature) and the loss's, before the update (``loss``); with a KL form, its largest |KL|
    (``kl``); where the objective read the old entropy, it and the advantages over the response tokens, in order
    (``old_entropy``, ``advantages``)."""
    objective, seen = trainer.objective, {"loss": 0.0}
    prepare, token_loss = objective.prepare, objective.token_loss

    def watched_prepare(batch, samples):
        mask = batch.response_mask
        seen["behaviour"] = _gap(batch.rollout_logprobs, batch.old_logprobs, mask)
        if batch.teacher_logprobs is not None:
            seen["teacher"] = _gap(batch.teacher_logprobs, batch.old_logprobs, mask)
        metrics = prepare(batch, samples)
        if batch.old_entropy is not None:
            seen["old_entropy"] = batch.old_entropy[mask.bool()].tolist()
            seen["advantages"] = batch.advantages[mask.bool()].tolist()
        return metrics

    def watched_loss(logp, vocab, mb):  # every micro-batch of the step's one update, before its optimizer step
        seen["loss"] = max(seen["loss"], _gap(logp, mb.old_logprobs, mb.response_mask))
        if vocab is not None:
            seen["kl"] = max(seen.get("kl", 0.0), float(vocab.detach().abs()[mb.response_mask.bool()].max()))
        return token_loss(logp, vocab, mb)

    objective.prepare, objective.token_loss = watched_prepare, watched_loss
    try:
        trainer.rl_step(1)
    finally:
        trainer.close()
    return seen
