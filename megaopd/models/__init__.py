"""The policy backends and what they share: the policy protocol, the HF policy, the Megatron backend, chat templating, checkpoints, the shared-prompt layout and the packaged/embedded models."""
