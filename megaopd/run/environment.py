"""The environment variables a launch script may set, turned into a run's config in one place.

A multi-node job learns only as it runs where its SGLang servers came up and which address its trainer node has
(slurm/stage_multinode.sbatch), and a machine may keep SGLang's or the sandbox's interpreter somewhere of its own: the
job or the user hands these over as environment variables. ``apply`` writes them into the config fields below, once,
where a run starts training (``trainer.train``: `megaopd train`, ``megaopd.models.megatron.launch``, `megaopd study`; the
sandbox's also for `megaopd eval`); every other module reads its config section, never the environment, and the
run's config.yaml records what it used.

    MEGAOPD_ROLLOUT_URLS=URL,...          rollout.sglang.urls, unless the config names servers
    MEGAOPD_TEACHER_URLS=ROUTE=URL,...    opd.teacher_urls: each URL joins its route's
    MEGAOPD_SYNC_ADDR=ADDRESS             rollout.sglang.sync_address, unless the config sets one
    MEGAOPD_SGLANG_PYTHON=PATH            rollout.sglang.python, unless the config sets one (also `megaopd rehearse`'s
                                          default --sglang-python)
    MEGAOPD_SANDBOX_NAMESPACES=0          verifier.sandbox.namespaces=false: the fallback mode, asked for
    MEGAOPD_SANDBOX_PYTHON=PATH           verifier.sandbox.python, unless the config sets one
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace

from megaopd.config import ConfigError, RunConfig, SandboxConfig, SGLangConfig


def apply(cfg: RunConfig, env: Mapping[str, str] = os.environ) -> RunConfig:
    """`cfg` with what the environment hands over filled in (see above); applying it twice changes nothing more."""
    return replace(cfg, rollout=replace(cfg.rollout, sglang=sglang_servers(cfg.rollout.sglang, env)),
                   opd=replace(cfg.opd, teacher_urls=teacher_urls(cfg.opd.teacher_urls, env)),
                   verifier=replace(cfg.verifier, sandbox=sandbox(cfg.verifier.sandbox, env)))


def sglang_servers(cfg: SGLangConfig, env: Mapping[str, str] = os.environ) -> SGLangConfig:
    return replace(cfg, urls=cfg.urls or _listed(env, "MEGAOPD_ROLLOUT_URLS"),
                   sync_address=cfg.sync_address or env.get("MEGAOPD_SYNC_ADDR", ""),
                   python=cfg.python or sglang_python(env))


def sglang_python(env: Mapping[str, str] = os.environ) -> str:
    """The interpreter of SGLang's own environment, if the environment names one ("" if not)."""
    return env.get("MEGAOPD_SGLANG_PYTHON", "")


def teacher_urls(urls: dict[str, list[str]], env: Mapping[str, str] = os.environ) -> dict[str, list[str]]:
    merged = {route: list(route_urls) for route, route_urls in urls.items()}
    for entry in _listed(env, "MEGAOPD_TEACHER_URLS"):
        route, _, url = entry.partition("=")
        if not (route and url):
            raise ConfigError(f"MEGAOPD_TEACHER_URLS: {entry!r} is not ROUTE=URL; give route=http://host:port, "
                              "comma-separated")
        if url not in merged.setdefault(route, []):
            merged[route].append(url)
    return merged


def sandbox(cfg: SandboxConfig, env: Mapping[str, str] = os.environ) -> SandboxConfig:
    return replace(cfg, namespaces=cfg.namespaces and env.get("MEGAOPD_SANDBOX_NAMESPACES", "1") != "0",
                   python=cfg.python or env.get("MEGAOPD_SANDBOX_PYTHON", ""))


def _listed(env: Mapping[str, str], name: str) -> list[str]:
    return [item for item in env.get(name, "").split(",") if item]
