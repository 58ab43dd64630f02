"""The model configuration: what a decoder computes, everything but its weights.

Pure: no torch import. `ModelConfig` holds every setting that changes the
math of a forward step; each of its fields goes into the forward key (through
kiln.core.plan.job), so two models that compute differently never share a compiled
forward. `kiln.core.model.hf_config.from_hf` builds one from a Hugging Face
`config.json`, refusing what Kiln does not compute; `check_tp` says whether a
tensor-parallel degree can split the model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kiln.core.errors import BadInput
from kiln.core.model import dsa_fields, llama4_fields
from kiln.core.model.dsa_fields import DsaFields
from kiln.core.model.expert_checks import check_experts
from kiln.core.model.param_counts import params_per_rank
from kiln.core.model.quant import WeightQuant
from kiln.core.model.shares import check_tp
from kiln.core.model.v4_fields import V4Fields, check_model

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
BUNDLED_MODEL = "tiny"
"""The model name that means Kiln's own small test model (TINY), not a checkpoint."""
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "qwen2_moe": "Qwen2MoeForCausalLM", "gemma2": "Gemma2ForCausalLM",
                 "gemma3_text": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
                 "deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v4": "DeepseekV4ForCausalLM",
                 "gpt_oss": "GptOssForCausalLM", "minimax_m2": "MiniMaxM2ForCausalLM",
                 "mistral4": "Mistral4ForCausalLM", "llama4_text": "Llama4ForCausalLM",
                 "deepseek_v32": "DeepseekV32ForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM"}
"""model_type -> the transformers class whose math Kiln reproduces."""
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")
LENGTH_DEPENDENT_ROPE = ("longrope", "dynamic")
"""Rope types whose frequencies depend on the sequence's length (transformers: max(position_ids) + 1 of the
call): a forward of such a model takes each sequence's length as an input (`seq_lens`)."""
ACTIVATIONS = ("silu", "gelu_tanh")
"""The gated MLP's activation: SwiGLU's silu, or GeGLU's tanh-approximated gelu (Gemma's gelu_pytorch_tanh)."""
@dataclass(frozen=True)
class ModelConfig:
    """What a decoder of a family Kiln reads computes (ARCHITECTURES), everything but its weights."""

    vocab_size: int
    """Rows of the embedding and of the output head."""
    hidden_size: int
    """Width of the residual stream."""
    num_layers: int
    """Decoder blocks."""
    num_heads: int
    """Query heads; split across tensor-parallel ranks."""
    num_kv_heads: int
    """Key/value heads (grouped-query attention); split across ranks."""
    head_dim: int
    """Width of one attention head."""
    intermediate_size: int
    """Width of the SwiGLU MLP; split across ranks."""
    rope_theta: float = 10000.0
    """Base of the rotary embedding frequencies."""
    rms_norm_eps: float = 1e-5
    """Epsilon of RMSNorm."""
    dtype: str = "float32"
    """Dtype of weights and activations; forwards are compiled in it."""
    architecture: str = "llama"
    """Hugging Face model_type: one of ARCHITECTURES."""
    rope_type: str = "default"
    """Rotary frequency scaling (ROPE_TYPES): default (none), linear (positions / rope_factor), llama3, yarn,
    longrope (short or long per-frequency factors by the sequence's length) or dynamic (NTK: the base grows
    with the sequence's length past rope_max_position)."""
    rope_factor: float = 1.0
    """linear, llama3 and yarn: the scaling factor."""
    rope_low_freq_factor: float = 1.0
    """llama3: wavelengths above original_max_position / this are divided by rope_factor."""
    rope_high_freq_factor: float = 4.0
    """llama3: wavelengths below original_max_position / this are kept; between, interpolated."""
    rope_original_max_position: int = 8192
    """llama3 and yarn: the context length the model was pretrained with."""
    rope_beta_fast: float = 32.0
    """yarn: dims turning more than this many times over the original context keep their frequency."""
    rope_beta_slow: float = 1.0
    """yarn: dims turning fewer than this many times are interpolated (divided by rope_factor); between, a ramp."""
    rope_truncate: bool = True
    """yarn: the ramp's bounds rounded outward to whole dims (transformers' `truncate`)."""
    rope_attention_factor: float = 1.0
    """Rotary cos and sin are multiplied by this (yarn's and longrope's attention factor, given or derived as
    transformers derives it); 1 for the other rope types."""
    rope_short_factor: tuple[float, ...] = ()
    """longrope: each frequency is divided by its factor here while the sequence is at most
    rope_original_max_position tokens long (one factor per rotated pair)..."""
    rope_long_factor: tuple[float, ...] = ()
    """...and by its factor here once it is longer."""
    rope_max_position: int = 0
    """dynamic: the length (max_position_embeddings) past which the base grows with the sequence's length."""
    qkv_bias: bool = False
    """q/k/v projections carry a bias (Qwen2; Llama's attention_bias)."""
    o_bias: bool = False
    """The attention output projection carries a bias (Llama's attention_bias)."""
    mlp_bias: bool = False
    """gate/up/down projections carry a bias (Llama's mlp_bias)."""
    tie_word_embeddings: bool = False
    """The output head is the embedding matrix (no lm_head.weight in the checkpoint)."""
    sliding_window: int | None = None
    """Tokens a query may look back (itself included) on sliding layers; None: unlimited."""
    first_sliding_layer: int = 0
    """Layers from this index on use the sliding window (Qwen2's max_window_layers); earlier ones do not."""
    qk_norm: bool = False
    """Each query and key head is RMS-normalised over head_dim, with its own weight, before the rotary
    embedding (Qwen3's q_norm / k_norm)."""
    qk_norm_whole: bool = False
    """With qk_norm: q and k each RMS-normalised over all their heads before the split (MiniMax-M2), the weights
    as wide, split over the ranks with the heads; each rank's sums of squares are summed over the ranks."""
    num_experts: int = 0
    """Experts of each mixture-of-experts layer (Mixtral's num_local_experts, Qwen3-MoE's num_experts)."""
    experts_per_token: int = 0
    """Experts a token is routed to (num_experts_per_tok): the top-k of the router's softmax."""
    moe_intermediate_size: int = 0
    """Width of one expert's SwiGLU MLP; split across ranks like the dense MLP."""
    norm_topk_prob: bool = True
    """The top-k routing weights are renormalised to sum to one (always for Mixtral)."""
    moe_layers: tuple[int, ...] = ()
    """The decoder layers whose MLP is the mixture of experts; the others keep the dense MLP
    (Qwen3-MoE's decoder_sparse_step and mlp_only_layers decide them). Empty: a dense model."""
    shared_expert_intermediate_size: int = 0
    """Width of the shared expert every token also runs on each mixture-of-experts layer, weighted by a
    sigmoid gate (Qwen2-MoE's shared_expert); split across ranks like the dense MLP. 0: none."""
    full_attention_layers: tuple[int, ...] = ()
    """Layers from first_sliding_layer on that still attend to all their context (Gemma's interleaving of
    sliding and full layers, its layer_types)."""
    activation: str = "silu"
    """The gated MLP's activation (ACTIVATIONS): silu, or gelu_tanh (Gemma's GeGLU)."""
    norm_unit_offset: bool = False
    """RMSNorm scales by (1 + weight), in float32 before the cast back (Gemma), not by weight after it."""
    sandwich_norms: bool = False
    """Gemma 2 and 3: the attention's output is normalised (post_attention_layernorm) before the residual add,
    and the MLP sits between pre_feedforward_layernorm and post_feedforward_layernorm."""
    embed_scale: bool = False
    """Embeddings are multiplied by sqrt(hidden_size), rounded to the dtype first (Gemma)."""
    query_pre_attn_scalar: float | None = None
    """Attention scores are scaled by this ** -0.5 (Gemma); None: head_dim ** -0.5."""
    attn_softcap: float | None = None
    """Attention scores pass through cap * tanh(score / cap) before the mask (Gemma 2's attn_logit_softcapping)."""
    final_softcap: float | None = None
    """Logits pass through cap * tanh(logit / cap) (Gemma 2's final_logit_softcapping)."""
    local_rope_theta: float | None = None
    """Sliding layers' rotary base, unscaled (Gemma 3's rope_local_base_freq); None: every layer uses rope_theta
    and its scaling."""
    rotary_dim: int | None = None
    """The leading dims of each query and key head that rotate, the rest pass through (Phi-3's
    partial_rotary_factor x head_dim); None: all of head_dim."""
    kv_lora_rank: int = 0
    """Multi-head latent attention (DeepSeek): the width of the compressed key/value latent that every head's
    keys and values are projected from, and that the KV cache holds (with the rotary key) instead of per-head
    keys and values. 0: ordinary attention."""
    q_lora_rank: int = 0
    """Latent attention: the width of the query's low-rank bottleneck (q_a_proj, q_a_layernorm, q_b_proj);
    0: one q_proj."""
    qk_rope_head_dim: int = 0
    """Latent attention: the dims of each query and key head that rotate; they come after the
    qk_nope_head_dim ones, and every head shares one rotary key (head_dim is their sum)."""
    v_head_dim: int = 0
    """Latent attention: the width of one head's values (the output projection reads heads x v_head_dim)."""
    rope_interleave: bool = False
    """The rotary embedding turns adjacent pairs (x0, x1), (x2, x3), ... of the rotated dims rather than
    their two halves (DeepSeek's rope_interleave)."""
    attn_scale_multiplier: float = 1.0
    """Attention scores' scale (head_dim ** -0.5) is multiplied by this: DeepSeek folds yarn's
    mscale(factor, mscale_all_dim) squared into it; 1 for every other model."""
    router: str = "softmax"
    """How a mixture of experts picks its experts (kiln.core.model.expert_checks.ROUTERS)."""
    num_expert_groups: int = 1
    """sigmoid_groups: the experts form this many equal groups (n_group)..."""
    topk_groups: int = 1
    """sigmoid_groups: ...and a token picks its experts within the best this many (topk_group), each group
    scored by the sum of its two best corrected scores."""
    routed_scaling_factor: float = 1.0
    """The chosen experts' routing weights are multiplied by this (DeepSeek's routed_scaling_factor)."""
    query_scale_beta: float = 0.0
    """Queries are multiplied by 1 + this x log(1 + floor(position / rope_original_max_position)) before the
    attention, growing with the position (Mistral 4's llama_4_scaling_beta); 0: never scaled."""
    attention_sinks: bool = False
    """Each query head has a learned sink logit (gpt-oss's `self_attn.sinks`): a column of the softmax that takes
    its share of the probability and attends to nothing."""
    swiglu_limit: float | None = None
    """gpt-oss's experts: gate clamped above and up clamped on both sides at this, then (up + 1) x gate x
    sigmoid(swiglu_alpha x gate); their router and projections carry biases. None: the SwiGLU of `activation`."""
    swiglu_alpha: float = 1.702
    """gpt-oss's experts: the sigmoid's gain in their clamped SwiGLU."""
    attention_chunk_size: int | None = None
    """Llama 4: the layers that rotate attend within chunks of this many positions (a query at p sees the keys
    from p - p % chunk to p); None: no chunks."""
    nope_layers: tuple[int, ...] = ()
    """Llama 4: the layers with no rope (no_rope_layers' zeros): full attention, unrotated q and k, no q/k norm,
    queries scaled by the attention temperature (kiln.core.model.llama4_fields)."""
    qk_l2_norm: bool = False
    """Llama 4's use_qk_norm: the rotating layers' q and k RMS-normalised over head_dim, weightless, after the rope."""
    temperature_floor: int = 0
    """Llama 4's attn_temperature_tuning: queries of the layers with no rope are multiplied by
    1 + temperature_scale x log1p(floor((position + 1) / this)); 0: never."""
    temperature_scale: float = 0.0
    """Llama 4's attn_scale (with temperature_floor)."""
    dsa: DsaFields | None = None
    """DeepSeek sparse attention's lightning indexer (kiln.core.model.dsa_fields): DeepSeek-V3.2's, GLM-5's."""
    v4: V4Fields | None = None
    """DeepSeek-V4's own settings (kiln.core.model.v4_fields), exactly when architecture is deepseek_v4; its rope_*
    fields are then the compressed layers' rope, qk_rope_head_dim the trailing rotated dims of its heads."""
    quant: WeightQuant | None = None
    """How the checkpoint's projections are quantized (kiln.core.model.quant: FP8 blocks), kept so in a rank's
    memory and dequantized in the graph to `dtype`, the compute dtype; None: every weight in `dtype`."""

    def __post_init__(self) -> None:
        for field in ("vocab_size", "hidden_size", "num_layers", "num_heads",
                      "num_kv_heads", "head_dim", "intermediate_size", "rope_original_max_position"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise BadInput(f"config.json: {field} must be a positive integer, got {value!r}.")
        if self.kv_lora_rank:
            self._check_latent()
        if isinstance(self.v4, dict):  # read back from JSON
            object.__setattr__(self, "v4", V4Fields(**self.v4))
        if isinstance(self.dsa, dict):
            object.__setattr__(self, "dsa", DsaFields(**self.dsa))
        if isinstance(self.quant, dict):  # read back from JSON
            object.__setattr__(self, "quant", WeightQuant(**self.quant))
        if self.quant is not None and (self.quant.method == "mxfp4") != (self.architecture == "gpt_oss"):
            raise BadInput("config.json: MXFP4 (quant_method mxfp4) is gpt-oss's format, and the only quantized "
                           "one Kiln reads for gpt-oss.")
        if self.quant is not None and self.quant.method == "mxfp4" and (self.hidden_size % 32
                                                                        or self.intermediate_size % 32):
            raise BadInput(f"config.json: MXFP4 experts hold 32 inputs a scale: hidden_size ({self.hidden_size}) "
                           f"and intermediate_size ({self.intermediate_size}) must be multiples of 32.")
        if self.quant is not None and self.architecture == "phi3":
            raise BadInput(f"config.json: quantized weights ({self.quant.method}) are read for every family but "
                           "Phi-3 (its fused qkv_proj and gate_up_proj).")
        v4_layout = self.quant is not None and (self.quant.scale_fmt, self.quant.experts) != ("float", "fp8")
        if v4_layout and self.v4 is None:
            raise BadInput(f"config.json: UE8M0 scales and FP4 experts ({self.quant}) are DeepSeek-V4's layout; "
                           "Kiln reads them in deepseek_v4 checkpoints only.")
        if (self.v4 is not None) != (self.architecture == "deepseek_v4"):
            raise BadInput("config.json: DeepSeek-V4's own fields (v4) go with model_type deepseek_v4, and only it.")
        if self.v4 is not None:
            check_model(self)
        if (self.swiglu_limit is not None or self.attention_sinks) != (self.architecture == "gpt_oss"):
            raise BadInput("config.json: attention sinks and the clamped SwiGLU experts (swiglu_limit) are gpt-oss's, "
                           "and every gpt_oss config has both.")
        if self.qk_norm_whole and not self.qk_norm:
            raise BadInput("config.json: qk_norm_whole (a q/k norm over all heads) needs qk_norm.")
        if self.num_heads % self.num_kv_heads:
            raise BadInput(
                f"config.json: num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads}).")
        if self.head_dim % 2:
            raise BadInput(f"config.json: head_dim ({self.head_dim}) must be even for rotary embeddings.")
        if self.rotary_dim is not None and (isinstance(self.rotary_dim, bool) or not isinstance(self.rotary_dim, int)
                                            or self.rotary_dim <= 0 or self.rotary_dim % 2
                                            or self.rotary_dim > self.head_dim):
            raise BadInput(f"config.json: the rotary dims (partial_rotary_factor x head_dim) must be an even number "
                           f"in 2..{self.head_dim}, got {self.rotary_dim!r}.")
        if self.dtype not in DTYPE_BYTES:
            raise BadInput(f"config.json: dtype {self.dtype!r} is not supported; use one of {sorted(DTYPE_BYTES)}.")
        if self.architecture not in ARCHITECTURES:
            raise BadInput(f"config.json: model_type {self.architecture!r} is not supported; "
                           f"Kiln computes {', '.join(sorted(ARCHITECTURES))}.")
        if self.rope_type not in ROPE_TYPES:
            raise BadInput(f"config.json: rope_type {self.rope_type!r} is not supported; "
                           f"Kiln computes {', '.join(ROPE_TYPES)}.")
        for field in ("rope_theta", "rope_factor", "rms_norm_eps", "rope_low_freq_factor", "rope_high_freq_factor",
                      "rope_beta_fast", "rope_beta_slow", "rope_attention_factor", "attn_scale_multiplier",
                      "routed_scaling_factor", "swiglu_alpha"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise BadInput(f"config.json: {field} must be a positive number, got {value!r}.")
        self._check_length_dependent_rope()
        if self.rope_type == "llama3" and not self.rope_high_freq_factor > self.rope_low_freq_factor:
            raise BadInput("config.json: rope_scaling high_freq_factor must be greater than low_freq_factor.")
        if self.sliding_window is not None and (
                not isinstance(self.sliding_window, int) or isinstance(self.sliding_window, bool)
                or self.sliding_window <= 0):
            raise BadInput(f"config.json: sliding_window must be a positive integer or null, got {self.sliding_window!r}.")
        if not isinstance(self.first_sliding_layer, int) or self.first_sliding_layer < 0:
            raise BadInput(f"config.json: max_window_layers must be >= 0, got {self.first_sliding_layer!r}.")
        object.__setattr__(self, "moe_layers", tuple(self.moe_layers))  # a list when read back from JSON
        object.__setattr__(self, "full_attention_layers", tuple(self.full_attention_layers))
        object.__setattr__(self, "nope_layers", tuple(self.nope_layers))
        llama4_fields.check(self)
        dsa_fields.check(self)
        if list(self.full_attention_layers) != sorted(set(self.full_attention_layers)) or not all(
                isinstance(i, int) and 0 <= i < self.num_layers for i in self.full_attention_layers):
            raise BadInput(f"config.json: the full-attention layers {list(self.full_attention_layers)} must be "
                           f"distinct layer indices below {self.num_layers}, in order.")
        if self.activation not in ACTIVATIONS:
            raise BadInput(f"config.json: activation {self.activation!r} is not supported; Kiln computes "
                           f"{', '.join(ACTIVATIONS)}.")
        for field in ("query_pre_attn_scalar", "attn_softcap", "final_softcap", "local_rope_theta", "swiglu_limit"):
            value = getattr(self, field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
                raise BadInput(f"config.json: {field} must be a positive number or null, got {value!r}.")
        if isinstance(self.query_scale_beta, bool) or not isinstance(self.query_scale_beta, (int, float)) \
                or self.query_scale_beta < 0:
            raise BadInput(f"config.json: llama_4_scaling_beta must be a number >= 0, got {self.query_scale_beta!r}.")
        if self.moe_layers:
            check_experts(self)

    def _check_length_dependent_rope(self) -> None:
        """longrope's two factor lists (one per rotated pair), dynamic's length; nothing of them elsewhere."""
        for field in ("rope_short_factor", "rope_long_factor"):
            value = getattr(self, field)
            object.__setattr__(self, field, tuple(value) if isinstance(value, (list, tuple)) else value)
            value = getattr(self, field)
            if self.rope_type != "longrope":
                if value != ():
                    raise BadInput(f"config.json: {field} is longrope's; this rope type is {self.rope_type!r}.")
                continue
            if not isinstance(value, tuple) or len(value) != self.rotated_dims // 2 or not all(
                    isinstance(f, (int, float)) and not isinstance(f, bool) and f > 0 for f in value):
                raise BadInput(f"config.json: longrope's {field.removeprefix('rope_')} must list "
                               f"{self.rotated_dims // 2} positive numbers (one per rotated pair of dims), "
                               f"got {value!r}.")
        if (self.rope_type == "dynamic") != (self.rope_max_position != 0) or (
                isinstance(self.rope_max_position, bool) or not isinstance(self.rope_max_position, int)
                or self.rope_max_position < 0):
            raise BadInput("config.json: the dynamic rope needs max_position_embeddings as a positive integer (and "
                           f"only it reads it), got {self.rope_max_position!r}.")

    @property
    def length_dependent_rope(self) -> bool:
        """The rotary frequencies depend on the sequence's length: forwards take `seq_lens`."""
        return self.rope_type in LENGTH_DEPENDENT_ROPE

    def _check_latent(self) -> None:
        """Latent attention's widths: positive, head_dim their sum, one key/value head per query head."""
        for field in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise BadInput(f"config.json: {field} must be a positive integer, got {value!r}.")
        if isinstance(self.q_lora_rank, bool) or not isinstance(self.q_lora_rank, int) or self.q_lora_rank < 0:
            raise BadInput(f"config.json: q_lora_rank must be a positive integer or null, got {self.q_lora_rank!r}.")
        if not 0 < self.qk_rope_head_dim < self.head_dim or self.qk_rope_head_dim % 2:
            raise BadInput(f"config.json: qk_rope_head_dim ({self.qk_rope_head_dim}) must be even and below the "
                           f"query/key head width qk_nope_head_dim + qk_rope_head_dim ({self.head_dim}).")
        if self.num_kv_heads != self.num_heads:
            raise BadInput(f"config.json: num_key_value_heads ({self.num_kv_heads}) must equal num_attention_heads "
                           f"({self.num_heads}) for latent attention: every head reads the one latent.")

    @property
    def latent(self) -> bool:
        """Attention is multi-head latent attention (DeepSeek): the cache holds a latent and a rotary key."""
        return self.kv_lora_rank > 0

    @property
    def qk_nope_head_dim(self) -> int:
        """Latent attention: the dims of each query and key head that do not rotate (they come first)."""
        return self.head_dim - self.qk_rope_head_dim

    @property
    def rotated_dims(self) -> int:
        """The dims of a head that the rotary embedding turns (qk_rope_head_dim, rotary_dim, else head_dim)."""
        return self.qk_rope_head_dim or self.rotary_dim or self.head_dim

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def is_moe(self, layer: int) -> bool:
        """Decoder layer `layer`'s MLP is the mixture of experts."""
        return layer in self.moe_layers

    def window_of(self, layer: int) -> int | None:
        """The sliding window of decoder layer `layer`, or None when it attends to all its context."""
        if layer < self.first_sliding_layer or layer in self.full_attention_layers:
            return None
        return self.sliding_window

    def to_dict(self) -> dict:
        """Every field, JSON-ready; `ModelConfig(**d)` reads it back."""
        return dataclasses.asdict(self)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def check_tp(self, tp: int) -> None:
        """Raise BadInput unless `tp` ranks can each hold a share of the model (kiln.core.model.shares: any tp
        that leaves every rank whole units of what it splits)."""
        check_tp(self, tp)

    def num_params(self) -> int:
        return params_per_rank(self, 1)


TINY = ModelConfig(vocab_size=1024, hidden_size=384, num_layers=2, num_heads=24,
                   num_kv_heads=12, head_dim=16, intermediate_size=1152)
"""The bundled tiny model: ~4M parameters; tp 1, 2, 3, 4 and 6 split it evenly, any tp up to 24 unevenly."""
