"""The embedded rollout engine: the project's DSV4 model behind SGLang's interface (`dsv4.rl.api`).

It serves RL rollouts where SGLang cannot run: on a CPU (CI, a laptop) and on one GPU, in the trainer's process
or behind `v4 rl serve`. A `generate` call is one static batch: every sample is fed token by token through the
cached decode step (`dsv4.rl.decode`), and the call returns when all have finished. The batch keeps its shape
to the end (a finished sample's row decodes tokens nobody reads), so on a GPU each step replays a CUDA graph
captured once per (batch rows, cache capacity) and kept for later calls, and the host reads one small copy of
the sampled tokens a step, a step late (`_generate_batch`). Concurrent calls queue; there is no continuous
batching.

What a result carries, and how it departs from SGLang 0.5.23:
* `output_token_logprobs` are log-probabilities after temperature and over `allowed_token_ids` when given (our
  extension), before top-k/top-p/min-p, which only shape the sampling; SGLang's are also after temperature.
  The trainer scores with the same temperature and restriction (`dsv4.rl.grpo.restricted_logprobs`).
* Sampling is Gumbel-max with noise from an integer hash of (seed, position, token): the same request with the
  same `sampling_seed` gives the same tokens whatever else is in the batch, on CPU and GPU alike. Without a
  seed, requests draw one from the engine's seed and a counter.
* `routed_experts` covers hash-routed layers too (SGLang leaves their rows zero); `model_info()["hash_layers"]`
  names those layers.
* Weight updates drain: `pause_generation`, `begin_weight_update` and every `update_weights_*` wait for the
  generation in flight to finish, and new generation waits until the update (or pause) ends, so no result
  mixes two weight versions. `pause_generation(mode="abort")` instead ends the batch in flight at its next
  step with finish reason "abort".
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from pathlib import Path

import torch

from dsv4 import quant
from dsv4.checkpoint import alias_to_official, iter_state_dict
from dsv4.config import ModelConfig
from dsv4.model import Transformer
from dsv4.rl import decode
from dsv4.rl.api import (SAMPLING_EPS, EngineUnavailable, GenerateRequest, GenerateResult, RequestError, SamplingParams,
                         ack)

_MASK32 = 0xFFFFFFFF


def hash_uniform(seeds: torch.Tensor, pos: int | torch.Tensor, vocab: int) -> torch.Tensor:
    """[B] int64 seeds -> [B, vocab] fp32 uniforms in (0, 1), a pure function of (seed, pos, token id).
    32-bit integer hashing in int64 arithmetic (no overflow), so CPU and GPU give the same bits. `pos` is an
    int (a kernel argument) or an int64 tensor on the seeds' device, 0-dim or [B] (a position per row); either
    way nothing waits for the device."""
    x = ((seeds & _MASK32) * 1000003 + pos) & _MASK32      # [B]: a 0-dim or [B] pos broadcasts
    x = (x.unsqueeze(-1) * 65537 + torch.arange(vocab, device=seeds.device)) & _MASK32
    for _ in range(3):
        x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    return ((x ^ (x >> 16)).double().add_(0.5) / 2.0 ** 32).float()


def scaled_logprobs(logits: torch.Tensor, temperature: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """log-softmax of logits / temperature over the allowed tokens ([B, V] bool, None = all). A temperature below
    SAMPLING_EPS is greedy and scores at 1.0, as in SGLang (dividing by 1e-40 overflows fp32 to inf and NaN)."""
    t = torch.where(temperature >= SAMPLING_EPS, temperature, torch.ones_like(temperature)).unsqueeze(-1)
    z = logits.float() / t
    if allowed is not None:
        z = z.masked_fill(~allowed, float("-inf"))
    return torch.log_softmax(z, dim=-1)


def sample(logp: torch.Tensor, sp: "BatchSampling", pos: int | torch.Tensor) -> torch.Tensor:
    """One token per row from `logp` (already tempered and restricted), after top-k, top-p and min-p, for
    position `pos` (int or int64 device tensor, see hash_uniform). Tensor ops only: no host synchronisation
    (which filters apply is decided on the host when the batch is built, `sp.any_filter`)."""
    keep = torch.isfinite(logp)
    if sp.any_filter:
        sorted_lp, order = logp.sort(dim=-1, descending=True)
        rank = torch.arange(logp.shape[-1], device=logp.device)
        probs = sorted_lp.exp()
        drop = (rank >= sp.top_k.unsqueeze(-1)) | (probs.cumsum(-1) - probs >= sp.top_p.unsqueeze(-1))
        drop |= probs < sp.min_p.unsqueeze(-1) * probs[:, :1]
        drop[:, 0].fill_(False)                             # the most likely token always survives
        keep &= ~torch.zeros_like(drop).scatter(-1, order, drop)
    gumbel = -torch.log(-torch.log(hash_uniform(sp.seeds, pos, logp.shape[-1])))
    noisy = torch.where(keep, logp + gumbel, float("-inf"))
    chosen = torch.where(sp.greedy, logp.argmax(-1), noisy.argmax(-1))
    return chosen


class BatchSampling:
    """The sampling parameters of a batch's rows as tensors."""

    def __init__(self, params: list[SamplingParams], seeds: list[int], vocab: int, device):
        def t(vals, dtype):
            return torch.tensor(vals, dtype=dtype, device=device)
        self.temperature = t([p.temperature for p in params], torch.float32)
        self.greedy = self.temperature < SAMPLING_EPS
        self.top_k = t([p.top_k if p.top_k > 0 else vocab for p in params], torch.long)
        self.top_p = t([p.top_p for p in params], torch.float32)
        self.min_p = t([p.min_p for p in params], torch.float32)
        self.any_filter = any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params)
        self.seeds = t(seeds, torch.long)
        self.allowed = None
        if any(p.allowed_token_ids for p in params):
            self.allowed = torch.ones(len(params), vocab, dtype=torch.bool, device=device)
            for i, p in enumerate(params):
                if p.allowed_token_ids:
                    self.allowed[i] = False
                    self.allowed[i, p.allowed_token_ids] = True

    def select(self, keep: torch.Tensor) -> None:
        for name in ("temperature", "greedy", "top_k", "top_p", "min_p", "seeds", "allowed"):
            v = getattr(self, name)
            if v is not None:
                setattr(self, name, v[keep])


class EmbeddedEngine:
    """RolloutEngine on the project's DSV4 model (see the module docstring)."""

    def __init__(self, model: Transformer, *, max_batch: int = 64, max_seq_len: int | None = None,
                 eos_token_id: int | None = None, model_path: str = "", seed: int = 0,
                 cuda_graphs: bool | None = None, max_decoders: int = 8):
        """cuda_graphs: replay each decode step from a CUDA graph captured per (batch rows, cache capacity);
        None = on where the model is on a GPU, unless DSV4_CUDA_GRAPHS=0. A capture that fails falls back to
        eager decoding with a warning. True on a CPU keeps the static shapes and the decoder reuse (what the
        GPU path does around the graph) and decodes eagerly. max_decoders: how many captured decoders (each
        with its KV cache) are kept for reuse."""
        self.model = model.eval()
        self.cfg: ModelConfig = model.cfg
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len or self.cfg.max_seq_len
        self.eos_token_id = eos_token_id
        self.model_path = model_path
        self.weight_version = "default"          # SGLang's initial version string
        self._seed, self._counter = seed, 0
        self._params = dict(model.named_parameters())
        self._cv = threading.Condition()
        self._active = 0                          # generate calls in flight
        self._blocked = set()                     # reasons new generation waits: "pause", "update"
        self._abort = False
        self._released: dict[str, torch.Tensor] | None = None
        self._groups: dict[str, object] = {}
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda" and os.environ.get("DSV4_CUDA_GRAPHS", "1") != "0"
        self._graphs = cuda_graphs
        self.max_decoders = max_decoders
        self._decoders: dict[tuple[int, int], decode.GraphedStep] = {}   # free decoders, least recently used first
        self._prepared = decode.Prepared.of(model)  # the decode step's forms of the weights, refreshed on updates

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_preset(cls, name: str = "tiny", overrides=(), seed: int = 0, device: str = "cpu", **kw):
        cfg = ModelConfig.preset(name, seed=seed).with_overrides(*overrides)
        return cls(Transformer(cfg).to(device), model_path=f"preset:{name}", seed=seed, **kw)

    @classmethod
    def from_checkpoint(cls, bf16_dir: str | Path, device: str = "cpu", overrides: dict | None = None, **kw):
        from dsv4.checkpoint import load_model_from_bf16
        model = load_model_from_bf16(bf16_dir, **(overrides or {}))
        return cls(model.to(device), model_path=str(bf16_dir), **kw)

    @property
    def device(self) -> torch.device:
        return self.model.embed.weight.device

    # ------------------------------------------------------------------ generation
    def generate(self, reqs: list[GenerateRequest]) -> list[GenerateResult]:
        for r in reqs:
            self._check_request(r)
        with self._generating():
            version = self.weight_version
            out: list[GenerateResult] = []
            for i in range(0, len(reqs), self.max_batch):
                out += self._generate_batch(reqs[i:i + self.max_batch], version)
            return out

    def _check_request(self, r: GenerateRequest) -> None:
        p, n = len(r.input_ids), r.sampling_params.max_new_tokens
        if p + n > self.max_seq_len:
            field = "input_ids" if p >= self.max_seq_len else "sampling_params.max_new_tokens"
            raise RequestError(field, f"requested {p + n} tokens ({p} prompt + {n} new), past the context limit "
                                      f"of {self.max_seq_len}; shorten the prompt or lower max_new_tokens")
        V = self.cfg.vocab_size
        for name, ids in (("input_ids", r.input_ids), ("sampling_params.allowed_token_ids",
                                                       r.sampling_params.allowed_token_ids or []),
                          ("sampling_params.stop_token_ids", r.sampling_params.stop_token_ids or [])):
            bad = [t for t in ids if not 0 <= t < V]
            if bad:
                raise RequestError(name, f"token id {bad[0]} outside the vocabulary [0, {V})")

    def _next_seed(self) -> int:
        self._counter += 1
        return (self._seed * 0x9E3779B1 + self._counter) & 0x7FFFFFFF

    # ------------------------------------------------------------------ decoding
    def _shape(self, batch: int, max_len: int) -> tuple[int, int]:
        """(rows, cache capacity) of a decoder for `batch` samples up to `max_len` tokens. With CUDA graphs both
        are rounded up to a power of two (rows within max_batch, capacity within max_seq_len), so a few captured
        decoders serve every call; without, they are exact (padding would only cost compute)."""
        if not self._graphs:
            return batch, max_len

        def pow2(n):
            return 1 << (n - 1).bit_length()
        return max(batch, min(pow2(batch), self.max_batch)), max(max_len, min(pow2(max_len), self.max_seq_len))

    def _take_decoder(self, rows: int, cap: int) -> decode.GraphedStep:
        """A decoder for (rows, cap), reused from an earlier call when one is free: its cache needs no reset
        (decode's docstring says why) and its graph is already captured. A concurrent call with the same shape
        gets its own."""
        with self._cv:
            dec = self._decoders.pop((rows, cap), None)
        if dec is None:
            dec = decode.GraphedStep(self.model, decode.DecodeCache(self.model, rows, cap), graph=self._graphs,
                                     prepared=self._prepared)
        return dec

    def _keep_decoder(self, dec: decode.GraphedStep) -> None:
        if not self._graphs:
            return                                # nothing to save: eager caches are cheap to rebuild
        with self._cv:
            self._decoders[(dec.cache.batch, dec.cache.max_len)] = dec
            while len(self._decoders) > self.max_decoders:  # the least recently used goes, cache and graph
                self._decoders.pop(next(iter(self._decoders)))

    def _drop_decoders(self) -> None:
        with self._cv:
            self._decoders.clear()

    @torch.no_grad()
    def _generate_batch(self, reqs: list[GenerateRequest], version: str) -> list[GenerateResult]:
        """Decode one batch. The batch keeps its shape until every sample has finished: a finished sample's row
        goes on decoding tokens nobody reads, so that a CUDA graph of the step replays unchanged (and rows are
        added, with the graphs, to round the batch up: see `_shape`). The host learns each step's tokens through
        one small device-to-host copy, read one step late: step t+1 is queued before the host waits for step t's
        tokens, so the GPU never idles on the host's bookkeeping; a sample that stopped at step t has one more
        step decoded for it, which is discarded."""
        t0 = time.perf_counter()
        dev, V, L = self.device, self.cfg.vocab_size, self.cfg.n_layers
        B = len(reqs)
        plen = [len(r.input_ids) for r in reqs]
        budget = [r.sampling_params.max_new_tokens for r in reqs]
        max_len = max(p + n for p, n in zip(plen, budget))
        R, cap = self._shape(B, max_len)
        pad = R - B                                # rows that only round the batch up: greedy on token 0
        seeds = [r.sampling_params.sampling_seed if r.sampling_params.sampling_seed is not None
                 else self._next_seed() for r in reqs] + [0] * pad
        sp = BatchSampling([r.sampling_params for r in reqs] + [SamplingParams(temperature=0.0)] * pad, seeds, V, dev)
        stops = [set(r.sampling_params.stop_token_ids or []) |
                 ({self.eos_token_id} if self.eos_token_id is not None and not r.sampling_params.ignore_eos else set())
                 for r in reqs]
        host_seq = torch.zeros(R, cap, dtype=torch.long)
        for i, r in enumerate(reqs):
            host_seq[i, :plen[i]] = torch.tensor(r.input_ids, dtype=torch.long)
        seq = host_seq.to(dev)
        prompt_len = torch.tensor(plen + [0] * pad, device=dev)
        want_routes = any(r.return_routed_experts for r in reqs)
        routes = torch.zeros(R, cap, L, self.cfg.n_activated_experts, dtype=torch.int32, device=dev) \
            if want_routes else None
        logps = torch.zeros(R, cap, device=dev)
        finish: list[dict | None] = [None] * B
        out_len = [0] * B
        for i, n in enumerate(budget):             # max_new_tokens=0: nothing to decode
            if n == 0:
                finish[i] = {"type": "length", "length": 0}

        # the one device-to-host copy a step: the sampled tokens, into one of two pinned buffers (one being
        # filled while the host reads the other), each with the event that says it has landed
        cuda = dev.type == "cuda"
        host_tok = [torch.zeros(R, dtype=torch.long, pin_memory=cuda) for _ in range(2)]
        landed = [torch.cuda.Event() if cuda else None for _ in range(2)]

        def account(nxt: int, buf: int) -> None:
            """The host's side of the step that sampled position `nxt`: lengths, stops, budgets."""
            if landed[buf] is not None:
                landed[buf].synchronize()
            toks = host_tok[buf].tolist()
            for i in range(B):
                if finish[i] is not None or plen[i] > nxt:  # finished, or still in its prompt
                    continue
                out_len[i] += 1
                if toks[i] in stops[i]:
                    finish[i] = {"type": "stop", "matched": toks[i]}
                elif out_len[i] >= budget[i]:
                    finish[i] = {"type": "length", "length": out_len[i]}

        decoder = self._take_decoder(R, cap)
        try:
            pos, pending, sampled, aborted = 0, None, 0, False
            while True:
                todo = [i for i in range(B) if finish[i] is None]
                launched = queued = False
                if todo and self._abort:
                    aborted = True
                # the last position any unfinished sample can still sample (its budget's end)
                elif todo and pos + 1 <= max(plen[i] + budget[i] - 1 for i in todo):
                    logits, r = decoder(seq[:, pos], pos)
                    if routes is not None:
                        routes[:, pos] = r
                    nxt = pos + 1
                    if nxt >= min(plen[i] for i in todo):   # some sample's prompt is consumed: it samples nxt
                        lp = scaled_logprobs(logits, sp.temperature, sp.allowed)
                        tok = sample(lp, sp, nxt)
                        sampling = prompt_len <= nxt        # rows past their prompt (the others keep it)
                        seq[:, nxt] = torch.where(sampling, tok, seq[:, nxt])
                        logps[:, nxt] = torch.where(sampling, lp.gather(-1, tok.unsqueeze(-1))[:, 0], logps[:, nxt])
                        buf = sampled % 2
                        host_tok[buf].copy_(tok, non_blocking=cuda)
                        if cuda:
                            landed[buf].record()
                        sampled += 1
                        queued = True
                    pos, launched = nxt, True
                if pending is not None:
                    account(*pending)
                pending = (pos, buf) if queued else None
                if not launched and pending is None:
                    break
        finally:
            self._keep_decoder(decoder)
        for i in range(B):
            if finish[i] is None:                   # only an abort leaves a sample unfinished
                finish[i] = {"type": "abort", "message": "generation paused with mode=abort",
                             "status_code": 503, "err_type": None} if aborted else \
                    {"type": "length", "length": out_len[i]}
        elapsed = time.perf_counter() - t0
        seq_h, logps_h = seq[:B].cpu(), logps[:B].cpu()
        routes_h = routes[:B].cpu() if routes is not None else None
        results = []
        for i, r in enumerate(reqs):
            p, n = plen[i], out_len[i]
            out_ids = seq_h[i, p:p + n].tolist()
            meta = {"id": r.rid or uuid.uuid4().hex, "finish_reason": finish[i], "prompt_tokens": p,
                    "completion_tokens": n, "cached_tokens": 0, "weight_version": version,
                    "e2e_latency": elapsed}
            if r.return_logprob:
                meta["output_token_logprobs"] = [[lp, t, None] for lp, t in
                                                 zip(logps_h[i, p:p + n].tolist(), out_ids)]
                meta["output_token_logprobs_length"] = n
            if r.return_routed_experts and routes_h is not None:
                # SGLang's rows: the tokens fed to the model from routed_experts_start_len on (the last sampled
                # token is never fed, so it has no route)
                meta["routed_experts"] = routes_h[i, r.routed_experts_start_len:p + n - 1].numpy()
            results.append(GenerateResult(out_ids, meta))
        return results

    # ------------------------------------------------------------------ concurrency
    @contextlib.contextmanager
    def _generating(self):
        with self._cv:
            self._cv.wait_for(lambda: not self._blocked)
            if self._released is not None:
                raise EngineUnavailable("the engine's weights are released (release_memory_occupation); "
                                        "call resume_memory_occupation first")
            self._active += 1
        try:
            yield
        finally:
            with self._cv:
                self._active -= 1
                self._cv.notify_all()

    def _block(self, reason: str, abort: bool = False) -> None:
        with self._cv:
            self._blocked.add(reason)
            self._abort = abort
            self._cv.wait_for(lambda: self._active == 0)
            self._abort = False

    def _unblock(self, reason: str) -> None:
        with self._cv:
            self._blocked.discard(reason)
            self._cv.notify_all()

    @contextlib.contextmanager
    def _updating(self):
        """Exclusive access for one weight update; inside begin/end_weight_update it is already held."""
        held = "update" in self._blocked
        if not held:
            self._block("update")
        try:
            yield
        finally:
            if not held:
                self._unblock("update")

    def pause_generation(self, mode: str = "retract") -> dict:
        if mode not in ("abort", "retract", "in_place"):
            raise RequestError("mode", f"{mode!r}: one of abort, retract, in_place")
        self._block("pause", abort=mode == "abort")
        return {"success": True, "message": "Generation paused successfully.", "status": "ok"}

    def continue_generation(self) -> dict:
        self._unblock("pause")
        return {"success": True, "message": "Generation continued successfully.", "status": "ok"}

    def begin_weight_update(self) -> dict:
        self._block("update")
        return ack(True, "weight update session begun")

    def end_weight_update(self) -> dict:
        self._unblock("update")
        return ack(True, "weight update session ended")

    def flush_cache(self) -> dict:
        # KV caches live for one generate call; nothing outlives it
        return ack(True, "Cache flushed.")

    # ------------------------------------------------------------------ weights
    def _resolve(self, name: str) -> str:
        if name in self._params:
            return name
        try:
            official = alias_to_official(name, self.cfg.n_layers)
        except (KeyError, ValueError, IndexError):
            official = None
        if official in self._params:
            return official
        raise KeyError(name)

    def load_named(self, named) -> int:
        """Copy (name, tensor) pairs into the model. Names are official (what the RL loop's weight sync sends) or
        their HF-style aliases, as SGLang's loader takes either; an FP8 e4m3 weight comes with its
        `.scale` / `.weight_scale_inv` (fp32 or e8m0) and is dequantised. All names and shapes are checked before
        anything is written. Returns the number of parameters written."""
        tensors = dict(named)
        scales = {n for n in tensors if n.endswith(".scale") or n.endswith(".weight_scale_inv")}
        plan = []
        for name, t in tensors.items():
            if name in scales:
                continue
            try:
                target = self._resolve(name)
            except KeyError:
                raise ValueError(f"{name}: not a parameter of this model ({self.cfg.n_layers} layers)") from None
            if t.is_complex() or t.dtype == torch.bool:
                # a cast would drop the imaginary part (or make 0/1 weights) without a word
                raise ValueError(f"{name}: dtype {str(t.dtype).removeprefix('torch.')} is not a weight dtype; send "
                                 f"real (floating-point, FP8 or integer) tensors")
            if t.dtype == torch.float8_e4m3fn:
                s = tensors.get(name[:-len("weight")] + "weight_scale_inv", tensors.get(name[:-len("weight")] + "scale"))
                if s is None:
                    raise ValueError(f"{name}: an FP8 weight without its scale (.weight_scale_inv or .scale) "
                                     "in the same update; keep each weight and its scale in one bucket")
                s = quant.from_e8m0(s) if s.dtype == torch.float8_e8m0fnu else s.float()
                t = quant.weight_dequant_fp8(t.to(self.device), s.to(self.device), dtype=torch.float32)
            p = self._params[target]
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"{name}: shape {tuple(t.shape)}, the model's {target} is {tuple(p.shape)}")
            plan.append((p, t))
        with torch.no_grad():
            for p, t in plan:
                p.copy_(t.to(device=p.device, dtype=p.dtype))
        return len(plan)

    def _update(self, load, weight_version: str | None) -> dict:
        with self._updating():
            if self._released is not None:
                return ack(False, "weights are released; call resume_memory_occupation before updating them")
            try:
                n = load()
            except (ValueError, OSError, RuntimeError) as e:
                return ack(False, str(e))
            finally:   # a failed load may have written some tensors before it stopped
                if self._prepared is not None:
                    self._prepared.refresh()
            if weight_version is not None:
                self.weight_version = str(weight_version)
            return ack(True, f"updated {n} tensors; weight_version={self.weight_version}")

    def update_weights_from_tensor(self, named_tensors, load_format: str | None = None, flush_cache: bool = True,
                                   weight_version: str | None = None) -> dict:
        if load_format not in (None, "direct"):
            return ack(False, f"load_format={load_format!r}: the embedded engine takes (name, tensor) pairs")
        return self._update(lambda: self.load_named(named_tensors), weight_version)

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None,
                                 weight_version: str | None = None, flush_cache: bool = True) -> dict:
        def load():
            if not (Path(model_path) / "config.json").is_file():
                raise ValueError(f"{model_path}: no config.json; expected a checkpoint directory "
                                 "(v4 ckpt dequantize output, or the trainer's disk sync)")
            # confine: the request names the directory, and nothing outside it (.. or a symlink) is opened
            return self.load_named(iter_state_dict(model_path, self.cfg, confine=True))
        res = self._update(load, weight_version)
        if res["success"]:
            self.model_path = str(model_path)
        return res

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str = "nccl",
                                  timeout_s: float | None = None) -> dict:
        """timeout_s (ours, not SGLang's): how long joining, and then each broadcast, may wait for the other ranks
        (the HTTP server passes its --group-timeout); None is dsv4.rl.sync's default."""
        from dsv4.rl.sync import weight_group
        try:
            self._groups[group_name] = weight_group(master_address, master_port, rank_offset, world_size,
                                                    backend, group_name,
                                                    **({} if timeout_s is None else {"timeout_s": timeout_s}))
        except (RuntimeError, ValueError, OSError) as e:
            return ack(False, f"could not join group {group_name!r} at {master_address}:{master_port}: {e}")
        return ack(True, f"joined {group_name!r} as rank {rank_offset} of {world_size}")

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        if self._groups.pop(group_name, None) is None:
            return ack(False, f"no weight update group {group_name!r}")
        return ack(True, f"left {group_name!r}")

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str = "weight_update_group", flush_cache: bool = True,
                                        weight_version: str | None = None, load_format: str | None = None) -> dict:
        from dsv4.rl.sync import receive_broadcast
        group = self._groups.get(group_name)
        if group is None:
            return ack(False, f"no weight update group {group_name!r}; call init_weights_update_group first")
        if not len(names) == len(dtypes) == len(shapes):
            return ack(False, f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, {len(shapes)})")
        return self._update(lambda: self.load_named(receive_broadcast(group, names, dtypes, shapes, self.device)),
                            weight_version)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        return self._params[self._resolve(name)].detach().flatten()[:truncate_size].float().cpu().tolist()

    # ------------------------------------------------------------------ memory
    def release_memory_occupation(self, tags: list[str] | None = None) -> dict:
        tags = tags or ["weights", "kv_cache", "cuda_graph"]
        with self._updating():
            if "weights" in tags and self._released is None and self.device.type == "cuda":
                self._released = {n: p.detach().to("cpu", copy=True) for n, p in self._params.items()}
                for p in self._params.values():
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                self._prepared = None
            if any(t in tags for t in ("weights", "kv_cache", "cuda_graph")):
                # the graphs read the parameters' old storage, and the caches are the KV memory
                self._drop_decoders()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        where = "moved to host memory" if self._released is not None else "no weights moved"
        return ack(True, f"released {tags}: {where}")

    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict:
        with self._updating():
            if self._released is not None and "weights" in (tags or ["weights"]):
                for n, p in self._params.items():
                    p.data = self._released[n].to(self.device)
                self._released = None
                self._drop_decoders()              # captured against storage that is gone
                self._prepared = decode.Prepared.of(self.model)
        return ack(True, "resumed")

    # ------------------------------------------------------------------ health and info
    def health(self) -> bool:
        return True

    def health_generate(self) -> bool:
        res = self.generate([GenerateRequest([0], SamplingParams(max_new_tokens=1, temperature=0))])
        return len(res[0].output_ids) == 1

    def model_info(self) -> dict:
        c = self.cfg
        return {"model_path": self.model_path, "served_model_name": self.model_path, "tokenizer_path": "",
                "is_generation": True, "preferred_sampling_params": None, "weight_version": self.weight_version,
                "load_format": None, "model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"],
                "engine": "embedded", "num_hidden_layers": c.n_layers, "num_experts_per_tok": c.n_activated_experts,
                "n_routed_experts": c.n_routed_experts, "hash_layers": [i for i in range(c.n_layers)
                                                                        if c.is_hash_layer(i)],
                "vocab_size": c.vocab_size, "max_context_length": self.max_seq_len,
                "attn_impl": c.attn_impl, "dtype": c.dtype, "device": str(self.device)}
