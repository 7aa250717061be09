"""Several rollout servers as one `RolloutEngine` (the trainer drives a fleet as it drives one engine).

`generate` splits a call's requests into contiguous shares, one per server, sent at once, and returns the results
in request order. Every control and weight call goes to every server, at once (joining a weight-update group
blocks until all members are there), and succeeds when all of them do. In a weight-update group each server
takes as many ranks as it has GPUs (`ranks`, TP x DP for SGLang, 1 for `v4 rl serve`), numbered one after another
from the caller's `rank_offset`, as miles and SGLang count them.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from dsv4.rl.api import GenerateRequest, GenerateResult, ack


class EngineGroup:
    def __init__(self, engines: list, ranks: list[int] | None = None):
        if not engines:
            raise ValueError("an engine group needs at least one engine")
        self.engines = list(engines)
        self.ranks = list(ranks) if ranks is not None else [1] * len(engines)
        if len(self.ranks) != len(self.engines) or min(self.ranks) < 1:
            raise ValueError(f"ranks {self.ranks} must give each of the {len(self.engines)} engines one or more")
        self.pool = ThreadPoolExecutor(max_workers=len(self.engines))

    def __repr__(self):
        return f"EngineGroup({self.engines!r})"

    @property
    def n_ranks(self) -> int:
        """Members this group adds to a weight-update group."""
        return sum(self.ranks)

    def _all(self, method: str, *args, per_engine=None, **kwargs) -> list:
        """`method` on every engine at once -> their answers, in engine order. `per_engine(i)` gives extra keyword
        arguments for engine i."""
        futures = [self.pool.submit(getattr(e, method), *args, **kwargs, **(per_engine(i) if per_engine else {}))
                   for i, e in enumerate(self.engines)]
        return [f.result() for f in futures]

    def _acked(self, method: str, *args, **kwargs) -> dict:
        answers = self._all(method, *args, **kwargs)
        failed = [f"{e!r}: {a.get('message')}" for e, a in zip(self.engines, answers)
                  if isinstance(a, dict) and not a.get("success", True)]
        return ack(not failed, "; ".join(failed) or f"{method} on {len(self.engines)} engine(s)")

    # ------------------------------------------------------------------ generation
    def generate(self, reqs: list[GenerateRequest]) -> list[GenerateResult]:
        n = len(self.engines)
        bounds = [len(reqs) * i // n for i in range(n + 1)]
        shares = [reqs[bounds[i]:bounds[i + 1]] for i in range(n)]
        futures = [self.pool.submit(e.generate, share) for e, share in zip(self.engines, shares) if share]
        return [r for f in futures for r in f.result()]

    # ------------------------------------------------------------------ weights
    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str = "nccl") -> dict:
        offsets = [rank_offset + sum(self.ranks[:i]) for i in range(len(self.engines))]
        return self._acked("init_weights_update_group", master_address, master_port, world_size=world_size,
                           group_name=group_name, backend=backend, per_engine=lambda i: {"rank_offset": offsets[i]})

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        return self._acked("destroy_weights_update_group", group_name)

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name: str = "weight_update_group",
                                        flush_cache: bool = True, weight_version: str | None = None,
                                        load_format: str | None = None) -> dict:
        return self._acked("update_weights_from_distributed", names, dtypes, shapes, group_name=group_name,
                           flush_cache=flush_cache, weight_version=weight_version, load_format=load_format)

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache: bool = True,
                                   weight_version: str | None = None) -> dict:
        return self._acked("update_weights_from_tensor", named_tensors, load_format=load_format,
                           flush_cache=flush_cache, weight_version=weight_version)

    def update_weights_from_disk(self, model_path: str, load_format=None, weight_version: str | None = None,
                                 flush_cache: bool = True) -> dict:
        return self._acked("update_weights_from_disk", model_path, load_format=load_format,
                           weight_version=weight_version, flush_cache=flush_cache)

    def begin_weight_update(self) -> dict:
        return self._acked("begin_weight_update")

    def end_weight_update(self) -> dict:
        return self._acked("end_weight_update")

    def pause_generation(self, mode: str = "retract") -> dict:
        return self._acked("pause_generation", mode)

    def continue_generation(self) -> dict:
        return self._acked("continue_generation")

    def flush_cache(self) -> dict:
        return self._acked("flush_cache")

    def release_memory_occupation(self, tags=None) -> dict:
        return self._acked("release_memory_occupation", tags)

    def resume_memory_occupation(self, tags=None) -> dict:
        return self._acked("resume_memory_occupation", tags)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """Every engine's values must agree (each got the same weights); the first's are returned."""
        values = self._all("get_weights_by_name", name, truncate_size=truncate_size)
        if any(v != values[0] for v in values[1:]):
            raise RuntimeError(f"{name}: the engines of the group hold different values after the same update")
        return values[0]

    # ------------------------------------------------------------------ health and info
    def is_ours(self) -> bool:
        return all(getattr(e, "is_ours", lambda: True)() for e in self.engines)

    def health(self) -> bool:
        return all(self._all("health"))

    def health_generate(self) -> bool:
        return all(self._all("health_generate"))

    def wait_healthy(self, deadline: float = 300.0) -> None:
        self._all("wait_healthy", deadline)

    def model_info(self) -> dict:
        return {**self.engines[0].model_info(), "engines": len(self.engines), "ranks": self.ranks}
