"""DeepSeek-V4 model configuration: one dataclass with the official (inference ModelArgs) field names.

This module must stay importable without torch: the launcher reads layer and expert counts from it.

Field names follow the official inference `ModelArgs`; the HF `config.json` keys are mapped in
`to_hf_config` / `from_hf_config` (one table, `_HF_KEYS`). Flags that are not in the official
arguments (QAT points, shared-expert clamp, attention implementation, compute dtype) are grouped at
the end of the dataclass.
"""
from __future__ import annotations

import dataclasses
import json
import shlex
from dataclasses import dataclass, field, fields

__all__ = ["ModelConfig", "PRESETS", "RUNTIME_SWITCHES", "parse_overrides"]


# fields that choose only how the same math runs (kernels, precision of a GEMM's partial products, compilation):
# `v4 bench step --compare` switches them on one trainer
RUNTIME_SWITCHES = ("attn_impl", "fp32_gemm", "moe_impl", "compiled", "head_loss")
COMPILED_REGIONS = ("hc", "attn", "moe", "norm", "sinkhorn")


@dataclass
class ModelConfig:
    # --- official ModelArgs fields (values: DeepSeek-V4-Flash) ---
    vocab_size: int = 129280
    dim: int = 4096
    n_layers: int = 43
    n_heads: int = 64
    head_dim: int = 512                  # K = V = one shared latent head (MQA); rope on the LAST rope_head_dim dims
    rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    window_size: int = 128
    # one entry per layer plus one per MTP layer; 0 = sliding window only, 4 = compressed + indexer,
    # anything else = heavily compressed (dense over all compressed entries, no indexer)
    compress_ratios: list[int] = field(default_factory=lambda: [0, 0] + [4, 128] * 20 + [4, 0])
    compress_rope_theta: float = 160000.0
    rope_theta: float = 10000.0
    rope_factor: float = 16.0
    original_seq_len: int = 65536
    beta_fast: int = 32
    beta_slow: int = 1
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    n_activated_experts: int = 6
    n_hash_layers: int = 3
    moe_inter_dim: int = 2048
    score_func: str = "sqrtsoftplus"     # sqrtsoftplus | sigmoid | softmax
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    norm_eps: float = 1e-6
    n_mtp_layers: int = 1
    max_seq_len: int = 4096              # length of the RoPE tables the model allocates
    max_position_embeddings: int = 1048576
    # checkpoint storage format (the official `dtype`/`expert_dtype`/`scale_fmt`/`scale_dtype`)
    weight_dtype: str = "fp8"            # fp8 | bf16: format of the attention/shared-expert/MTP linears on disk
    expert_dtype: str = "fp4"            # fp4 | fp8 | bf16: format of the routed experts on disk
    scale_fmt: str = "ue8m0"             # ue8m0 (power-of-two scales) | none (amax/448)
    scale_dtype: str = "fp8"             # fp8 (e8m0 scale tensors) | fp32

    # --- switches of this reference implementation (not in the official args) ---
    dtype: str = "bf16"                  # bf16 | fp32: parameter and activation dtype of the reference model
    attn_impl: str = "torch"             # torch | tilelang: passed to dsv4.kernels dispatchers
    qat_kv_fp8: bool = False             # QAT points 1+2: FP8 (1x64, ue8m0) on the nope dims of window and compressed KV
    qat_indexer_fp4: bool = False        # QAT points 3+4: FP4 (1x32) on the indexer's Hadamard-rotated q and k
    fp8_gemm_inputs: bool = False        # FP8 linears: act 1x128 + weight 128x128 quant-dequant (straight-through)
    mxfp4_experts: bool = False          # routed-expert weights quant-dequant through MXFP4 (straight-through)
    # RL with FP8 weight sync: every weight the sync sends as FP8 (the FP8- and FP4-stored linears) goes through the
    # same 128x128 ue8m0 quant-dequant in the forward, so the trainer scores the weights the rollout samples with
    qat_rollout_fp8: bool = False
    shared_expert_clamp: bool = True     # official clamps the shared expert's SwiGLU too; MILES training does not
    # the fp32-weight GEMMs on CUDA (the LM head; the compressors' kv and gate projections): "bf16x3" = three bf16
    # tensor-core GEMMs on split operands (~2^-16 per product, dsv4/kernels/split_gemm.py), forward and backward;
    # "bf16x3_fwd" = the forward so, the backward's two GEMMs one bf16 GEMM each (the gradient at bf16 precision, as
    # every other layer's); "fp32" = one fp32 GEMM on the CUDA cores. A CPU always runs the fp32 GEMM.
    fp32_gemm: str = "bf16x3_fwd"
    # training's regions through torch.compile on CUDA, "+"-separated (or "none"): "hc" = the hyper-connections (the
    # Sinkhorn iterations forward and backward in a few kernels), "attn" = the attention's per-head q norm and
    # rotations, "moe" = the routed experts' gated activation (moe_impl grouped), "norm" = the RMSNorms; "sinkhorn"
    # (with hc) = the compiled hyper-connections call the fused Triton Sinkhorn forward and backward
    # (dsv4/kernels/triton_sinkhorn.py: two launches where inductor's form takes ~120)
    compiled: str = "hc+attn+moe+norm"
    # the routed experts in training on CUDA (a rank's local experts at any EP): "grouped" = one grouped GEMM per weight
    # over all experts, the weight gradients added straight into megatron's fp32 main_grad by one accumulating GEMM
    # per expert; "grouped_autograd" = the same forward, bf16 weight gradients that megatron's hook then adds (the
    # A/B baseline); "grouped_triton" = the same forward, every expert's weight gradient accumulated into its
    # main_grad by one Triton grouped GEMM (dsv4/kernels/triton_grouped_wgrad.py); "loop" = one GEMM per expert, as
    # the reference (and a CPU) runs them
    moe_impl: str = "grouped"
    # the LM head's loss at TP = 1 on CUDA: "eager" = fp32 logits, then F.cross_entropy (log-softmax kept for the
    # backward); "fused" = the head GEMM and the cross-entropy as one autograd function that keeps what the
    # backward needs in bf16 and writes the logits' gradient in bf16 (dsv4/kernels/head_loss.py): 2-4 % off the H200
    # step and 3.5-7.8 GB off its peak, the losses equal (docs/training.md); elsewhere (TP > 1, a CPU, fp32_gemm other
    # than bf16x3_fwd) the eager loss runs
    head_loss: str = "fused"
    indexer_loss_coeff: float = 0.0      # weight of the KL indexer loss that trainers add (the model only reports it)
    seed: int = 0                        # deterministic initialisation

    # ------------------------------------------------------------------ derived facts
    @property
    def n_dense_layers(self) -> int:
        return 0  # every V4 layer is MoE (first_k_dense_replace = 0)

    @property
    def compiled_regions(self) -> tuple[str, ...]:
        return tuple(r for r in self.compiled.split("+") if r and r != "none")

    def layer_ratio(self, layer_id: int) -> int:
        """Compression ratio of layer `layer_id` (MTP layers are numbered n_layers, n_layers+1, ...)."""
        return self.compress_ratios[layer_id]

    def attn_kind(self, layer_id: int) -> str:
        r = self.layer_ratio(layer_id)
        return "window" if r == 0 else "csa" if r == 4 else "hca"

    def is_hash_layer(self, layer_id: int) -> bool:
        return layer_id < self.n_hash_layers and layer_id < self.n_layers  # MTP is never hash-routed

    # ------------------------------------------------------------------ validation
    def validate(self) -> "ModelConfig":
        errs = []
        need = self.n_layers + self.n_mtp_layers
        if len(self.compress_ratios) != need:
            errs.append(f"compress_ratios has {len(self.compress_ratios)} entries; needs n_layers + n_mtp_layers = {need} "
                        f"(one per layer plus one per MTP layer); pass compress_ratios=[...] with {need} entries")
        for i, r in enumerate(self.compress_ratios):
            if r < 0 or r == 1:
                errs.append(f"compress_ratios[{i}] = {r}: use 0 (window only), 4 (indexer) or a ratio >= 2")
        for i in range(self.n_layers, need):
            if self.compress_ratios[i:i + 1] and self.compress_ratios[i] != 0:
                errs.append(f"compress_ratios[{i}] (MTP) = {self.compress_ratios[i]}: the MTP block is window-only (0)")
        if self.head_dim % 2 or self.rope_head_dim % 2 or self.rope_head_dim > self.head_dim:
            errs.append(f"head_dim={self.head_dim}, rope_head_dim={self.rope_head_dim}: both even, rope <= head")
        if self.rope_head_dim > self.index_head_dim:
            errs.append(f"index_head_dim={self.index_head_dim} < rope_head_dim={self.rope_head_dim}")
        if self.index_head_dim & (self.index_head_dim - 1):
            errs.append(f"index_head_dim={self.index_head_dim} must be a power of two (Hadamard rotation)")
        if (self.n_heads * self.head_dim) % self.o_groups:
            errs.append(f"n_heads*head_dim={self.n_heads * self.head_dim} not divisible by o_groups={self.o_groups}")
        if self.n_heads % self.o_groups:
            errs.append(f"n_heads={self.n_heads} not divisible by o_groups={self.o_groups} (heads are grouped contiguously)")
        if not 0 < self.n_activated_experts <= self.n_routed_experts:
            errs.append(f"n_activated_experts={self.n_activated_experts} must be in 1..n_routed_experts={self.n_routed_experts}")
        if self.n_shared_experts != 1:
            errs.append(f"n_shared_experts={self.n_shared_experts}: V4 has exactly one shared expert")
        if self.score_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
            errs.append(f"score_func={self.score_func!r}: one of sqrtsoftplus, sigmoid, softmax")
        if self.dtype not in ("bf16", "fp32"):
            errs.append(f"dtype={self.dtype!r}: one of bf16, fp32")
        if self.attn_impl not in ("torch", "tilelang"):
            errs.append(f"attn_impl={self.attn_impl!r}: one of torch, tilelang")
        if self.fp32_gemm not in ("fp32", "bf16x3", "bf16x3_fwd"):
            errs.append(f"fp32_gemm={self.fp32_gemm!r}: one of fp32, bf16x3, bf16x3_fwd")
        if self.moe_impl not in ("loop", "grouped", "grouped_autograd", "grouped_triton"):
            errs.append(f"moe_impl={self.moe_impl!r}: one of loop, grouped, grouped_autograd, grouped_triton")
        if self.head_loss not in ("eager", "fused"):
            errs.append(f"head_loss={self.head_loss!r}: one of eager, fused")
        if not set(self.compiled_regions) <= set(COMPILED_REGIONS):
            errs.append(f"compiled={self.compiled!r}: regions joined by '+', from {', '.join(COMPILED_REGIONS)} "
                        "(or none)")
        elif "sinkhorn" in self.compiled_regions and "hc" not in self.compiled_regions:
            errs.append(f"compiled={self.compiled!r}: sinkhorn puts the fused Sinkhorn into the compiled "
                        "hyper-connections; add hc (compiled=hc+sinkhorn)")
        if self.weight_dtype not in ("fp8", "bf16") or self.expert_dtype not in ("fp4", "fp8", "bf16"):
            errs.append(f"weight_dtype={self.weight_dtype!r} (fp8|bf16), expert_dtype={self.expert_dtype!r} (fp4|fp8|bf16)")
        if self.hc_mult < 1 or self.n_layers < 1:
            errs.append(f"hc_mult={self.hc_mult}, n_layers={self.n_layers}: both >= 1")
        if errs:
            raise ValueError("invalid ModelConfig:\n  " + "\n  ".join(errs))
        return self

    # ------------------------------------------------------------------ presets and overrides
    @classmethod
    def preset(cls, name: str, **overrides) -> "ModelConfig":
        if name not in PRESETS:
            raise KeyError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides}).validate()

    def with_overrides(self, *specs: str, **kw) -> "ModelConfig":
        """New config with fields replaced. `specs` are "key=value" strings (several may share one string,
        separated by spaces, as in PRESET_MODEL_OVERRIDES="n_routed_experts=16 n_layers=2"); `kw` are typed.
        When n_layers changes and compress_ratios is not given, the ratio list is cut or extended (repeating
        the last two main-layer entries) and the MTP entries are kept."""
        kw = {**parse_overrides(*specs), **kw}
        unknown = sorted(set(kw) - {f.name for f in fields(self)})
        if unknown:
            raise KeyError(f"unknown model config field(s) {unknown}; known fields: {', '.join(f.name for f in fields(self))}")
        new = dataclasses.replace(self, **{k: _coerce(self, k, v) for k, v in kw.items()})
        if "compress_ratios" not in kw and ("n_layers" in kw or "n_mtp_layers" in kw):
            main = list(self.compress_ratios[:self.n_layers])
            while len(main) < new.n_layers:
                main.append(main[-2] if len(main) >= 2 else main[-1])
            mtp = list(self.compress_ratios[self.n_layers:]) + [0] * new.n_mtp_layers
            new.compress_ratios = main[:new.n_layers] + mtp[:new.n_mtp_layers]
        return new.validate()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    # ------------------------------------------------------------------ HF config.json
    def to_hf_config(self) -> dict:
        hf = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4"}
        for hf_key, off_key in _HF_KEYS.items():
            hf[hf_key] = getattr(self, off_key)
        hf.update(
            num_key_value_heads=1, kv_lora_rank=self.head_dim, topk_method="noaux_tc", norm_topk_prob=True,
            first_k_dense_replace=0, tie_word_embeddings=False, torch_dtype="bfloat16",
            rope_scaling={"type": "yarn", "factor": self.rope_factor,
                          "original_max_position_embeddings": self.original_seq_len,
                          "beta_fast": self.beta_fast, "beta_slow": self.beta_slow},
            expert_dtype=self.expert_dtype,
        )
        if self.weight_dtype == "fp8":
            hf["quantization_config"] = {
                "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [128, 128], **({"scale_fmt": "ue8m0"} if self.scale_fmt == "ue8m0" else {}),
            }
        return hf

    @classmethod
    def from_hf_config(cls, hf: dict | str, **overrides) -> "ModelConfig":
        """Accepts the parsed config.json or a path to it. Unknown HF keys are ignored."""
        if isinstance(hf, str):
            with open(hf) as f:
                hf = json.load(f)
        kw = {off: hf[key] for key, off in _HF_KEYS.items() if key in hf}
        rs = hf.get("rope_scaling") or {}
        for hf_key, off_key in (("factor", "rope_factor"), ("original_max_position_embeddings", "original_seq_len"),
                                ("beta_fast", "beta_fast"), ("beta_slow", "beta_slow")):
            if hf_key in rs:
                kw[off_key] = rs[hf_key]
        q = hf.get("quantization_config")
        kw["weight_dtype"] = "fp8" if q and q.get("quant_method") == "fp8" else "bf16"
        kw["scale_fmt"] = (q or {}).get("scale_fmt", "ue8m0" if q else "none") or "none"
        if "expert_dtype" in hf:
            kw["expert_dtype"] = {"bfloat16": "bf16"}.get(hf["expert_dtype"], hf["expert_dtype"])
        kw.setdefault("max_seq_len", min(int(kw.get("max_position_embeddings", 4096)), 4096))
        kw.update(overrides)
        return cls(**kw).validate()

    # ------------------------------------------------------------------ size
    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Official parameter names -> logical (unquantized) shapes, in model order. `embed`/`head` are
        shared with MTP and listed once. This is the single source for parameter inventories that must
        not allocate tensors (name maps, checkpoint generation); tests check it equals the model's."""
        d, hc = self.dim, self.hc_mult
        s: dict[str, tuple[int, ...]] = {"embed.weight": (self.vocab_size, d)}

        def block(p: str, layer_id: int):
            mix = (2 + hc) * hc
            for sub in ("attn", "ffn"):
                s[f"{p}hc_{sub}_fn"] = (mix, hc * d)
                s[f"{p}hc_{sub}_base"] = (mix,)
                s[f"{p}hc_{sub}_scale"] = (3,)
            a = f"{p}attn."
            s[a + "attn_sink"] = (self.n_heads,)
            s[a + "wq_a.weight"] = (self.q_lora_rank, d)
            s[a + "q_norm.weight"] = (self.q_lora_rank,)
            s[a + "wq_b.weight"] = (self.n_heads * self.head_dim, self.q_lora_rank)
            s[a + "wkv.weight"] = (self.head_dim, d)
            s[a + "kv_norm.weight"] = (self.head_dim,)
            s[a + "wo_a.weight"] = (self.o_groups * self.o_lora_rank, self.n_heads * self.head_dim // self.o_groups)
            s[a + "wo_b.weight"] = (d, self.o_groups * self.o_lora_rank)
            ratio = self.layer_ratio(layer_id)
            if ratio:
                _compressor(s, a + "compressor.", ratio, self.head_dim, d)
            if ratio == 4:
                i = a + "indexer."
                s[i + "wq_b.weight"] = (self.index_n_heads * self.index_head_dim, self.q_lora_rank)
                s[i + "weights_proj.weight"] = (self.index_n_heads, d)
                _compressor(s, i + "compressor.", ratio, self.index_head_dim, d)
            s[f"{p}attn_norm.weight"] = (d,)
            s[f"{p}ffn_norm.weight"] = (d,)
            f = f"{p}ffn."
            s[f + "gate.weight"] = (self.n_routed_experts, d)
            if self.is_hash_layer(layer_id):
                s[f + "gate.tid2eid"] = (self.vocab_size, self.n_activated_experts)
            else:
                s[f + "gate.bias"] = (self.n_routed_experts,)
            for e in [f"experts.{j}." for j in range(self.n_routed_experts)] + ["shared_experts."]:
                s[f + e + "w1.weight"] = (self.moe_inter_dim, d)
                s[f + e + "w2.weight"] = (d, self.moe_inter_dim)
                s[f + e + "w3.weight"] = (self.moe_inter_dim, d)

        for i in range(self.n_layers):
            block(f"layers.{i}.", i)
        for k in range(self.n_mtp_layers):
            p = f"mtp.{k}."
            block(p, self.n_layers + k)
            s[p + "e_proj.weight"] = (d, d)
            s[p + "h_proj.weight"] = (d, d)
            s[p + "enorm.weight"] = (d,)
            s[p + "hnorm.weight"] = (d,)
            s[p + "norm.weight"] = (d,)
            _hc_head(s, p, hc, d)
        s["norm.weight"] = (d,)
        s["head.weight"] = (self.vocab_size, d)
        _hc_head(s, "", hc, d)
        return s

    def storage_format(self, name: str) -> str:
        """How the released checkpoint stores official parameter `name`: "fp8" (e4m3 + 128x128 `.scale`),
        "fp4" (MXFP4: int8 packed [out, in/2] + e8m0 `.scale` [out, in/32]), or a plain dtype "bf16" | "fp32" |
        "int32". The single source for the generator, the dequantizer and the model's QAT points."""
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "tid2eid":
            return "int32"
        if leaf in ("attn_sink", "ape", "bias") or leaf.startswith("hc_"):
            return "fp32"
        if ".experts." in name and leaf == "weight":
            return self.expert_dtype
        fp8_linears = (".attn.wq_a.", ".attn.wq_b.", ".attn.wkv.", ".attn.wo_a.", ".attn.wo_b.",
                       ".indexer.wq_b.", ".shared_experts.w1.", ".shared_experts.w2.", ".shared_experts.w3.",
                       ".e_proj.", ".h_proj.")
        if leaf == "weight" and any(p in "." + name for p in fp8_linears):
            return self.weight_dtype
        return "bf16"  # embed, head, norms, compressor wkv/wgate, indexer weights_proj, gate.weight

    def n_params(self, active: bool = False) -> int:
        """Parameter count (logical elements; tid2eid excluded). active=True counts one token's path:
        n_activated_experts routed experts per layer instead of all of them."""
        total = 0
        for name, shape in self.param_shapes().items():
            if name.endswith("tid2eid"):
                continue
            if active and ".experts." in name and int(name.split(".experts.")[1].split(".")[0]) >= self.n_activated_experts:
                continue
            n = 1
            for x in shape:
                n *= x
            total += n
        return total


def _compressor(s: dict, p: str, ratio: int, head_dim: int, dim: int) -> None:
    coff = 2 if ratio == 4 else 1  # overlapping windows iff ratio == 4 (hard-coded in the official model)
    s[p + "ape"] = (ratio, coff * head_dim)
    s[p + "wkv.weight"] = (coff * head_dim, dim)
    s[p + "wgate.weight"] = (coff * head_dim, dim)
    s[p + "norm.weight"] = (head_dim,)


def _hc_head(s: dict, p: str, hc: int, dim: int) -> None:
    s[p + "hc_head_fn"] = (hc, hc * dim)
    s[p + "hc_head_base"] = (hc,)
    s[p + "hc_head_scale"] = (1,)


# HF config.json key -> ModelConfig field (the §1.1 table; rope_scaling is handled separately)
_HF_KEYS = {
    "vocab_size": "vocab_size", "hidden_size": "dim", "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads", "head_dim": "head_dim", "qk_rope_head_dim": "rope_head_dim",
    "q_lora_rank": "q_lora_rank", "o_groups": "o_groups", "o_lora_rank": "o_lora_rank",
    "sliding_window": "window_size", "compress_ratios": "compress_ratios",
    "compress_rope_theta": "compress_rope_theta", "rope_theta": "rope_theta",
    "index_n_heads": "index_n_heads", "index_head_dim": "index_head_dim", "index_topk": "index_topk",
    "hc_mult": "hc_mult", "hc_sinkhorn_iters": "hc_sinkhorn_iters", "hc_eps": "hc_eps",
    "n_routed_experts": "n_routed_experts", "n_shared_experts": "n_shared_experts",
    "num_experts_per_tok": "n_activated_experts", "num_hash_layers": "n_hash_layers",
    "moe_intermediate_size": "moe_inter_dim", "scoring_func": "score_func",
    "routed_scaling_factor": "route_scale", "swiglu_limit": "swiglu_limit", "rms_norm_eps": "norm_eps",
    "num_nextn_predict_layers": "n_mtp_layers", "max_position_embeddings": "max_position_embeddings",
}

_FLASH: dict = {}  # the dataclass defaults are Flash
PRESETS: dict[str, dict] = {
    "flash": _FLASH,
    "pro": dict(
        dim=7168, n_layers=61, n_heads=128, q_lora_rank=1536, o_groups=16, o_lora_rank=1024,
        moe_inter_dim=3072, n_routed_experts=384, route_scale=2.5, index_topk=1024,
        compress_ratios=[128, 128] + [4, 128] * 29 + [4, 0],
    ),
    # Flash dimensions, 4 layers: window, window, CSA, HCA, plus the window-only MTP block (stage-A smoke runs)
    "4layer": dict(n_layers=4, compress_ratios=[0, 0, 4, 128, 0]),
    # CPU-sized but exercising every path: layer 0 window-only + hash-routed, layer 1 CSA (ratio 4 + indexer),
    # layer 2 heavily compressed (ratio 16 stands in for 128), layer 3 CSA, MTP window-only and score-routed.
    # dim and head_dim are multiples of 128 so FP8 128x128 blocks apply; index_head_dim is a power of two.
    "tiny": dict(
        vocab_size=512, dim=128, n_layers=4, n_heads=4, head_dim=128, rope_head_dim=64, q_lora_rank=64,
        o_groups=2, o_lora_rank=64, window_size=8, compress_ratios=[0, 4, 16, 4, 0],
        compress_rope_theta=160000.0, rope_factor=4.0, original_seq_len=64,
        index_n_heads=4, index_head_dim=64, index_topk=4, hc_mult=4, hc_sinkhorn_iters=20,
        n_routed_experts=8, n_activated_experts=2, n_hash_layers=1, moe_inter_dim=64,
        max_seq_len=256, max_position_embeddings=256, dtype="fp32",
    ),
}


def parse_overrides(*specs: str) -> dict:
    """'key=value' strings -> dict of raw strings (typed later against the dataclass)."""
    out = {}
    for spec in specs:
        for item in shlex.split(spec):
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise ValueError(f"model override {item!r} is not key=value (e.g. n_layers=2)")
            out[key.strip()] = value.strip()
    return out


def _coerce(cfg: ModelConfig, key: str, value):
    """Convert a string override to the type of the field it replaces."""
    if not isinstance(value, str):
        return value
    current = getattr(cfg, key)
    try:
        if isinstance(current, bool):
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if isinstance(current, int):
            return int(value)
        if isinstance(current, float):
            return float(value)
        if isinstance(current, list):
            items = json.loads(value) if value.startswith("[") else [v for v in value.split(",") if v]
            return [int(v) for v in items]
    except ValueError:
        raise ValueError(f"model override {key}={value!r}: expected a {type(current).__name__} "
                         f"like {key}={json.dumps(current) if isinstance(current, list) else current}") from None
    return value
