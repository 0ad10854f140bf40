"""A pool of SGLang servers serving one model: work is split across them and survives a server dying.

Data-parallel rollouts and teacher scoring both go through ``ServerPool.map``: one JSON payload per chunk of work,
chunks spread over the live servers in threads. A chunk whose server fails (after its own retries) is not lost:
a server megaopd launched is restarted once (with the weights it last served); an attached one, or one that
fails again, is dropped, and the chunk moves to the next live server. Only when none is left does the step fail.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from megaopd.config import SGLangConfig
from megaopd.rollout.serving.server import ServerError, SGLangServer

log = logging.getLogger(__name__)


def split_evenly(items: list, parts: int) -> list[list]:
    """Contiguous, near-equal chunks, none empty."""
    size = -(-len(items) // max(parts, 1))
    return [items[i:i + size] for i in range(0, len(items), size)] if items else []


class ServerPool:
    def __init__(self, servers: list[SGLangServer], cfg: SGLangConfig, name: str):
        if not servers:
            raise ValueError(f"{name}: no SGLang servers (give URLs or let megaopd launch them)")
        self.servers, self.cfg, self.name = list(servers), cfg, name
        self.restarted: set[str] = set()
        self.dropped: dict[str, str] = {}  # URL -> the error it was dropped for: names the node when all are gone
        self.lock = threading.Lock()  # one recovery at a time

    @classmethod
    def launch_or_attach(cls, model_path: str, urls: list[str], cfg: SGLangConfig, dtype: str, log_dir: Path,
                         name: str) -> "ServerPool":
        if urls:
            servers = [SGLangServer(url) for url in urls]
            for server in servers:
                server.wait_healthy(cfg.startup_timeout_s)
        else:
            servers = [SGLangServer.launch(model_path, cfg, dtype, log_dir / f"{name}_{i}.log")
                       for i in range(cfg.num_servers)]
        return cls(servers, cfg, name)

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def map(self, path: str, payloads: list[dict]) -> list:
        """POST payload i to some live server and return the answers in payload order."""
        if not payloads:
            return []
        with ThreadPoolExecutor(max_workers=len(self.servers)) as threads:
            futures = [threads.submit(self._post_with_failover, path, payload, i)
                       for i, payload in enumerate(payloads)]
            return [f.result() for f in futures]

    def prefill_logprobs(self, sequences: list[list[int]], start: list[int] | None = None,
                         top_k: int = 0) -> list[dict]:
        """Teacher scoring by prefill alone: for each sequence, the logprob of every token from ``start[i]`` on
        (``logprobs``: element j scores token start[i] + j), the ``top_k`` most likely tokens there (``top``: j ->
        [(logprob, id)] when top_k > 0), and the weight version that scored it. ``logprob_start_len`` tells the
        server where to begin, so its LM head and log-softmax run over those rows only (0: the whole sequence)."""
        start = start if start is not None else [1] * len(sequences)
        chunks = split_evenly(list(range(len(sequences))), len(self.servers))
        payloads = [{"input_ids": [sequences[i] for i in chunk],
                     "sampling_params": {"max_new_tokens": 0},
                     # With logprob_start_len = L the server answers for tokens L..n-1 and the first entry is null
                     # (position L - 1 is not projected): start one token early and drop it.
                     "return_logprob": True, "logprob_start_len": [start[i] - 1 for i in chunk],
                     **({"top_logprobs_num": top_k} if top_k else {})} for chunk in chunks]
        answers = [a for chunk_answers in self.map("/generate", payloads) for a in chunk_answers]
        return [{"logprobs": [lp for lp, _, _ in a["meta_info"]["input_token_logprobs"][1:]],
                 "top": [[(lp, tok) for lp, tok, _ in row] for row in a["meta_info"]["input_top_logprobs"][1:]]
                 if top_k else [], "weight_version": a["meta_info"]["weight_version"]} for a in answers]

    def broadcast(self, path: str, payload: dict) -> list:
        """POST the same payload to every server (weight updates): a failure here is an error, never a skip."""
        with ThreadPoolExecutor(max_workers=len(self.servers)) as threads:
            futures = [threads.submit(s.post, path, payload, self.cfg.request_timeout_s, self.cfg.retries)
                       for s in self.servers]
            return [f.result() for f in futures]

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def _post_with_failover(self, path: str, payload: dict, index: int):
        attempt = 0
        while True:
            live = list(self.servers)
            if not live:
                raise ServerError(f"{self.name}: every SGLang server failed: "
                                  + "; ".join(f"{url}: {error}" for url, error in self.dropped.items()))
            server = live[(index + attempt) % len(live)]
            try:
                return server.post(path, payload, self.cfg.request_timeout_s, self.cfg.retries)
            except ServerError as error:
                log.error("%s: %s", self.name, error)
                self._recover(server, error)
                attempt += 1

    def _recover(self, server: SGLangServer, error: ServerError) -> None:
        with self.lock:
            if server not in self.servers or server.healthy():
                return  # another thread already restarted or dropped it
            if server.launched and server.url not in self.restarted:
                self.restarted.add(server.url)
                try:
                    server.restart(self.cfg.startup_timeout_s)
                    return
                except ServerError as restart_error:
                    log.error("%s: restart failed: %s", self.name, restart_error)
                    error = restart_error
            log.error("%s: dropping SGLang server %s", self.name, server.url)
            self.dropped[server.url] = str(error)
            server.stop()
            self.servers.remove(server)
