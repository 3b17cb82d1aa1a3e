"""Predict training memory per GPU, part by part.

Model states follow the ZeRO paper (Rajbhandari et al. 2019): with mixed precision and Adam a model of
Psi parameters needs 2*Psi (16-bit weights) + 2*Psi (16-bit gradients) + 12*Psi (fp32 master weights and
two moments) bytes, and ZeRO stages 1, 2, 3 split the optimizer states, then the gradients, then the
weights over the data-parallel GPUs. The optimizer part includes the fp32 master copy, as in the paper.

Activations are counted from the tensors that `transformers`' Llama layers save for backward (see
`activation_terms`), so lab 01 can hold the prediction against a measurement. With activation
checkpointing what forward saves and what backward rebuilds are never alive together: the figure is
then the step's peak, the largest of its phases (`activation_bytes`), which lab 06 and the tests hold
against the live tensor bytes of a whole step.

The parts are sizes, and `total` adds them up as if all were alive at once. They are not: gradients
live from backward to `zero_grad`, activations from forward to backward, and a multi-tensor optimizer
allocates temporaries in its step. `peak` is the most alive at one moment of the step
(`step_moments`), which tests/test_step_peak.py holds against the live bytes of whole training steps.

Tensor parallelism (`tp_degree` t, Megatron's layout as `gpulab.tensor_parallel` applies it) splits each
layer's projections, the embedding and the LM head over t GPUs and keeps the norms whole; the
activations inside attention and the MLP shrink t-fold, those around the norms only with sequence
parallelism (Korthikanti et al. 2022, section 4.2). `world_size` stays the data-parallel size.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Union

from gpulab.memory.policy import Precision, get_optimizer, get_precision, optimizer_state_bytes
from gpulab.memory.shapes import ModelShape

PARTS = ("parameters", "gradients", "optimizer", "activations", "backward_extra", "kv_cache")
ALL_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QUANT_BITS = {"nf4": 4, "fp4": 4, "int8": 8}
QUANT_BLOCK = 64  # QLoRA's block size for 4-bit weights
DOUBLE_QUANT_BLOCK = 256  # block size of the second-level (8-bit) quantization of the absmax values


# the first torch whose FSDP2 frees a layer's all-gather buffer in forward before the next layer's copy-out
FSDP2_FREES_BUFFER_FIRST = "2.15"


def torch_minor(version: str) -> tuple[int, int]:
    """(2, 15) from "2.15", "2.15.0" or "2.15.0+cu132"."""
    major, _, rest = version.partition(".")
    minor = rest.split(".")[0].split("+")[0]
    if not (major.isdigit() and minor.isdigit()):
        raise ValueError(f"torch_version must look like '2.13' or torch.__version__, got {version!r}")
    return int(major), int(minor)


@dataclass(frozen=True)
class TrainingSetup:
    """How the model is trained; `batch_size` and `seq_len` are per GPU (one micro-batch)."""

    precision: str = "bf16"
    optimizer: str = "adamw"
    zero_stage: int = 0
    world_size: int = 1
    batch_size: int = 1
    seq_len: int = 0  # 0: activations are not counted
    attention: str = "sdpa"  # "eager" also keeps the (batch, heads, seq, seq) attention probabilities
    padding_mask: bool = False  # batches padded to a length: SDPA then gets an explicit (b, 1, s, s) mask
    checkpointing: bool = False  # keep only each segment's input, recompute the rest in backward
    checkpoint_every: int = 1  # layers per checkpointed segment: 1 is per layer, ~sqrt(layers) the sqrt(n) rule
    lora_rank: int = 0  # 0: full fine-tuning
    lora_targets: tuple[str, ...] = ALL_LINEARS
    quantization: str | None = None  # frozen base weights in "nf4", "fp4" or "int8" (QLoRA)
    double_quant: bool = True
    kv_cache_len: int = 0  # tokens of KV cache held (inference); 0: none
    kv_cache_batch: int = 1
    tp_degree: int = 1  # tensor-parallel GPUs per layer; world_size is then the data-parallel size
    sequence_parallel: bool = False  # with tp_degree > 1: norms and residual stream sharded on the sequence
    # cross-entropy over chunks of this many tokens, each under a checkpoint (`gpulab.losses.chunked_lm_loss`):
    # forward keeps no log-softmax over the vocabulary, backward rebuilds one chunk's at a time; 0: whole
    loss_chunk_tokens: int = 0
    # micro-batches per optimizer step: from the second one on, backward starts with every gradient
    # alive (without accumulation `zero_grad(set_to_none=True)` leaves none when forward runs)
    grad_accumulation: int = 1
    # the PyTorch whose FSDP2 the ZeRO-2 peak counts ("2.15", or a torch.__version__ such as "2.15.0+cu132"):
    # up to 2.14 forward holds a layer's all-gather buffer while the next layer copies out of its own
    torch_version: str = "2.13"

    def __post_init__(self) -> None:
        torch_minor(self.torch_version)  # refuses what is not a version
        get_precision(self.precision)
        get_optimizer(self.optimizer)
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        for name in ("world_size", "batch_size", "kv_cache_batch", "checkpoint_every", "tp_degree",
                     "grad_accumulation"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("seq_len", "lora_rank", "kv_cache_len", "loss_chunk_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")
        if self.attention not in ("sdpa", "eager"):
            raise ValueError(f"attention must be 'sdpa' or 'eager', got {self.attention!r}")
        if self.quantization is not None and self.quantization not in QUANT_BITS:
            raise ValueError(f"quantization must be one of {', '.join(QUANT_BITS)} or None")
        unknown = set(self.lora_targets) - set(ALL_LINEARS)
        if unknown:
            raise ValueError(f"unknown LoRA targets {sorted(unknown)}; choose from {', '.join(ALL_LINEARS)}")
        if self.tp_degree > 1 and (self.lora_rank or self.quantization):
            raise ValueError("tensor parallelism is modelled for full training only (no LoRA, no quantized weights)")

    @property
    def fsdp2_frees_buffer_first(self) -> bool:
        """Whether this torch's FSDP2 frees a layer's all-gather buffer in forward before the next layer
        copies out of its own (2.15 and later); up to 2.14 both are alive during that copy."""
        return torch_minor(self.torch_version) >= torch_minor(FSDP2_FREES_BUFFER_FIRST)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU for each part of training."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    kv_cache: int
    trainable_params: int
    # What the step's peak holds beyond `activations`: without checkpointing, `activations` is what
    # forward saves, and the start of backward adds the loss's two fp32 gradients over the vocabulary
    # (or the last layer's backward its temporaries, if larger); with checkpointing `activations`
    # already is the step's peak and this is 0 (`ActivationTerms.peak` is the whole of it).
    backward_extra: int = 0
    # The step's peak: the most bytes alive at one moment (`step_moments`), and that moment. The parts
    # are not all alive at once: gradients exist from backward to `zero_grad`, activations from
    # forward to backward, so the peak is usually below `total`, or above it by the optimizer's
    # temporaries.
    peak: int = 0
    peak_moment: str = ""
    notes: tuple[str, ...] = field(default=())
    # ZeRO-2 over several GPUs, with a shape and a sequence length: the step's peak as PyTorch's FSDP2
    # runs stage 2 (`reshard_after_forward=False`: shards at rest), beside `peak`'s DeepSpeed count
    fsdp2_zero2_peak: int = 0

    @property
    def total(self) -> int:
        """The sum of the parts: every part as if alive at once (the ZeRO paper's model states)."""
        return sum(getattr(self, part) for part in PARTS)

    def to_dict(self) -> dict[str, int | str]:
        return {**{part: getattr(self, part) for part in PARTS}, "total": self.total, "peak": self.peak,
                "peak_moment": self.peak_moment}

    def table(self, unit: str = "GB") -> str:
        """A plain-text table; unit "GB" (10^9 bytes) or "GiB" (2^30 bytes)."""
        scale = {"GB": 1e9, "GiB": 2**30, "MB": 1e6, "MiB": 2**20}[unit]
        rows = [(part, getattr(self, part)) for part in PARTS] + [("total", self.total), ("peak", self.peak)]
        lines = [f"{'part':<14} {unit:>12}"]
        lines += [f"{name:<14} {value / scale:>12.3f}" for name, value in rows]
        lines.append(f"peak at: {self.peak_moment}")
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


Model = Union[ModelShape, int, float]


def quantized_bytes_per_param(kind: str, double_quant: bool) -> float:
    """Storage of one frozen weight: the code itself plus its share of the scaling constants."""
    if kind == "int8":
        return 1.0  # plus one fp32 scale per output row, added by the caller
    constants = 4 / QUANT_BLOCK  # one fp32 absmax per block
    if double_quant:  # absmax in 8 bits, with one fp32 constant per 256 of them (QLoRA, 0.127 bits)
        constants = 1 / QUANT_BLOCK + 4 / (QUANT_BLOCK * DOUBLE_QUANT_BLOCK)
    return QUANT_BITS[kind] / 8 + constants


@dataclass(frozen=True)
class ActivationTerms:
    """What one training step's activations are made of, in bytes per GPU (see `activation_bytes`).

    The terms, as the forward pass saves them: `input`, one segment input (the residual stream,
    b x s x hidden); `layer`, what one decoder layer saves; `head`, what the final norm, the LM head and
    the loss save (the loss value and the batch's int64 ids included); `shared`, RoPE's tables, kept
    once; `segments`, how many segment inputs a checkpointed forward keeps (0 without checkpointing);
    `held`, layers whose saved tensors are alive together in backward (all of them without
    checkpointing, the k layers of one segment with it). What the step holds besides:
    `loss_gradients`, the two fp32 gradients of b x s x vocab that the loss's backward makes;
    `labels_copy`, the int64 shifted labels it frees first; `layer_temporaries`, the most a layer's
    backward holds at once beyond the layers' saved tensors (its MLP's gradients, less the SwiGLU
    product it has freed by then); `checkpoint_args`, what the checkpoints keep for the recomputation
    (positions, a mask); `autocast_cache`, autocast's 16-bit weight copies, cached through all of
    forward (with checkpointing they are not saved, so they are extra); `logits`, the LM head's output
    and its fp32 copy, alive while the loss is computed; `ids`, the batch's token ids,
    which the embedding saves but which exist before the step (so the live count leaves them out).
    """

    input: float
    layer: float
    head: float
    shared: float
    segments: int
    held: int
    ids: float
    loss_gradients: float
    labels_copy: float
    layer_temporaries: float
    checkpoint_args: float = 0.0
    autocast_cache: float = 0.0
    logits: float = 0.0

    SEED = 4  # backward's seed, the loss's gradient of 1: a fp32 scalar

    @property
    def saved(self) -> float:
        """What autograd saves for backward: in forward and, with checkpointing, in one segment's
        recomputation. Without checkpointing it is all alive at the end of forward; with it, the two
        parts never coexist (the sum the calculator reported before it counted phases)."""
        return self.segments * self.input + self.held * self.layer + self.head + self.shared

    @property
    def kept(self) -> float:
        """Live bytes at the end of forward, once autocast has exited: with checkpointing the segment
        inputs, the head, RoPE's tables and the checkpoints' arguments; without it, all that is saved."""
        layers = 0 if self.segments else self.held * self.layer
        return (self.segments * self.input + layers + self.head + self.shared + self.checkpoint_args
                - self.ids)

    @property
    def end_of_forward(self) -> float:
        """Phase 1, the forward pass as the loss is computed: what is kept, autocast's weight cache and
        the logits. A lower bound of forward's peak: a layer's working set is not counted (in a
        checkpointed segment nothing is saved, but a layer's intermediates live while it runs)."""
        return self.kept + self.autocast_cache + self.logits

    @property
    def start_of_backward(self) -> float:
        """Phase 2: all that forward kept, plus the loss's two fp32 gradients (less the labels' copy,
        which `nll_loss`'s backward frees first) and the seed."""
        return self.kept + self.loss_gradients - self.labels_copy + self.SEED

    @property
    def backward_of_layers(self) -> float:
        """Phase 3, backward through the last segment (or, without checkpointing, the last layer): the
        head's tensors are gone but the loss and the seed; the segment inputs, the segment's k layers,
        rebuilt, and the gradients of its last layer's backward are alive."""
        head_freed = self.head - self.ids - 4  # the caller still holds the loss
        return self.kept - head_freed + (self.held * self.layer if self.segments else 0) \
            + self.layer_temporaries + self.SEED

    @property
    def phases(self) -> dict[str, float]:
        return {"end of forward": self.end_of_forward, "start of backward": self.start_of_backward,
                "backward of the layers": self.backward_of_layers}

    @property
    def peak(self) -> float:
        """The largest phase: the peak of a step is a max over phases, not a sum."""
        return max(self.phases.values())

    @property
    def phase(self) -> str:
        """Where the peak comes (the first phase that reaches it)."""
        return max(self.phases, key=self.phases.__getitem__)


def activation_terms(shape: ModelShape, setup: TrainingSetup) -> ActivationTerms:
    """The terms of one training step's activations for a `transformers` Llama model, per GPU.

    What the forward pass saves for backward is counted tensor by tensor. Three element sizes set the
    count: `a`, what matmuls and attention produce (4 in fp32, 2 in any 16-bit policy); `r`, the
    residual stream between layers, which has the weights' dtype (2 when the model itself is 16-bit,
    4 in fp32 and under autocast, where the weights stay fp32); and fp32 (4), which RMSNorm and the
    loss use whatever the policy. Per token, each decoder layer saves (h hidden, i intermediate,
    kv = kv heads x head dim):
    - two RMSNorms, each: its input upcast to fp32 (4h), an fp32 1/rms (4), the normalized values in
      the stream's dtype (rh) and the scaled output the next projections read (rh). Under autocast
      that output is fp32 and every projection casts it to 16 bits itself, keeping its own copy:
      3 copies (q, k, v) after the first norm, 2 (gate, up) after the second;
    - attention with fused SDPA: q, k, v (h + 2kv), the output, which o_proj reads in place (h), and
      an fp32 log-sum-exp per head; with eager attention k and v are first repeated to all heads
      (q, k, v, o_proj input: 4h) and the fp32 softmax probabilities are kept, heads x seq per token,
      the term that grows with the square of the sequence. In 16 bits they are kept twice: the fp32
      softmax output and the 16-bit copy the next matmul reads;
    - the SwiGLU MLP: gate, SiLU(gate), up and their product (4i).
    The head keeps the final norm (as above, one projection reading it) and the fp32 log-softmax over
    the vocabulary; token ids and labels are int64 (for one sequence the shifted labels keep their
    padded s + 1 storage). A padded batch (`padding_mask`) hands SDPA an explicit (b, 1, s, s) mask,
    which every layer keeps, and k and v are then repeated to all heads as in eager. RoPE's cos and
    sin are kept once, in the stream's dtype. Under autocast the 16-bit copies of the linear weights
    (LM head included) are saved too. With checkpointing the layers run in segments of
    `checkpoint_every`: each segment keeps only its input (rh per token), and backward recomputes one
    segment at a time, holding that segment's activations (weight copies included).
    What is saved is exact on a CPU for fp32, bf16/fp16 autocast and 16-bit models, SDPA and eager,
    padded or not, checkpointed or not (the tests check each); CUDA's attention kernels save slightly
    different extras (a few bytes per head and token). The phases built from these terms
    (`ActivationTerms`) match live tensor bytes to the byte on a CPU in fp32 and in 16-bit models;
    under autocast the backward of the layers is a lower bound (the gradients' 16-bit casts come on
    top, a few per cent), and so is the forward pass everywhere (what is kept, autocast's weight cache
    and the logits are counted, a layer's working set is not; forward stays below the other phases
    but under autocast with checkpointing, where the weight cache makes it the peak). Under tensor
    parallelism the phases follow the same terms; they are not measured there.

    With tensor parallelism (`tp_degree` t) each GPU keeps 1/t of what attention and the MLP save
    (its heads and its MLP channels, and its share of the weight copies), while the norms' tensors and
    their outputs, which the projections read, are whole on every GPU: Korthikanti et al.'s
    sbh(10 + 24/t + 5as/(ht)) per layer, in this model's terms. With `sequence_parallel` the norms,
    their outputs and the checkpointed layer inputs are split on the sequence too, so the whole layer
    is 1/t: the paper's sbh(34 + 5as/h)/t. That count keeps each block's input in its sharded form,
    as Megatron-LM does (it all-gathers it again in backward); PyTorch's `SequenceParallel` keeps the
    gathered input instead (`torch_sequence_parallel_extra_bytes`). The LM head's input, the logits'
    log-softmax, the labels, RoPE's tables and a padding mask stay whole (the plan gathers the logits).
    Measured against DTensor and hand-written tensor parallelism in lab 14 (fp32, exact).
    """
    prec = get_precision(setup.precision)
    a, r, fp32 = prec.act_bytes, prec.weight_bytes, 4
    autocast = prec.weight_copy_bytes > 0
    b, s = setup.batch_size, setup.seq_len
    tokens = b * s
    h, i, kv, heads = shape.hidden_size, shape.intermediate_size, shape.kv_dim, shape.num_heads
    t = setup.tp_degree
    seq_split = t if setup.sequence_parallel else 1  # what the sequence-parallel regions divide by

    def norm_inside() -> float:  # bytes per token an RMSNorm saves itself: fp32 input, 1/rms, normalized
        return (fp32 * h + fp32 + r * h) / seq_split

    def norm_out(readers: int) -> float:  # its output, as the projections that read it keep it
        return (readers * a * h if autocast else r * h) / seq_split

    if setup.attention == "eager":
        probs_bytes = fp32 + (a if a < fp32 else 0)  # fp32 softmax, plus its 16-bit copy
        attn = 4 * h * a + heads * s * probs_bytes
    elif setup.padding_mask:
        attn = 4 * h * a + heads * fp32
    else:
        attn = (2 * h + 2 * kv) * a + heads * fp32
    per_layer = tokens * (norm_inside() + norm_out(3) + (attn + 4 * i * a) / t + norm_inside() + norm_out(2))
    if setup.padding_mask and setup.attention == "sdpa":
        per_layer += b * s * s * a  # each layer keeps its own copy of the mask
    per_layer += shape.layer_linear_params() * prec.weight_copy_bytes / t
    shared = 2 * s * shape.head_dim * r  # RoPE's cos and sin, kept once for all layers
    # the head: the final norm, its output whole (the LM head reads the gathered sequence), the fp32
    # log-softmax over the vocabulary (none with a chunked loss: each chunk's is rebuilt in backward),
    # int64 ids and labels, the loss
    chunk = min(setup.loss_chunk_tokens, tokens) if setup.loss_chunk_tokens else 0
    log_softmax = 0 if chunk else fp32 * shape.vocab_size
    head = tokens * (norm_inside() + norm_out(1) * seq_split + log_softmax + 2 * 8) + fp32
    if b == 1:
        head += 8  # the loss pads labels to s + 1 and shifts them: one row needs no copy, keeps s + 1
    head += shape.vocab_size * h * prec.weight_copy_bytes / t  # the LM head's weight copy
    if setup.checkpointing:
        held = min(setup.checkpoint_every, shape.num_layers)
        segments = -(-shape.num_layers // held)
    else:
        held, segments = shape.num_layers, 0
    # backward of a layer peaks in its MLP: once down_proj's backward has freed the SwiGLU product, the
    # product's gradient and the two gradients its backward makes (of SiLU(gate) and of up) are alive
    # with the gradient of the residual stream
    temporaries = tokens * (r * h / seq_split + 2 * a * i / t)
    checkpoint_args, cache = 0.0, 0.0
    if setup.checkpointing:
        held = min(setup.checkpoint_every, shape.num_layers)
        segments = -(-shape.num_layers // held)
        # a checkpoint keeps its arguments for the recomputation: the positions (int64) and the mask,
        # if the model makes one (eager: b x 1 x s x s in the activations' dtype; SDPA with padding: bool)
        checkpoint_args = 8 * s
        if setup.attention == "eager":
            checkpoint_args += b * s * s * (a if prec.name.endswith("pure") else r)
        elif setup.padding_mask:
            checkpoint_args += b * s * s
        if r == fp32:  # the first norm's "fp32 input" is the segment input itself, kept once
            temporaries -= tokens * h * r / seq_split
        # autocast caches the 16-bit copy of every weight until its region exits: through all of forward
        cache = shape.num_layers * shape.layer_linear_params() * prec.weight_copy_bytes / t
    else:
        held, segments = shape.num_layers, 0
    return ActivationTerms(input=tokens * h * r / seq_split, layer=per_layer, head=head, shared=shared,
                           segments=segments, held=held, ids=tokens * 8,
                           # chunked: one chunk's rebuilt log-softmax and its two gradients, and, from
                           # the second chunk on, the hidden states' gradient that the chunks add up
                           loss_gradients=(3 * chunk * fp32 * shape.vocab_size
                                           + (tokens * h * r if chunk < tokens else 0) if chunk
                                           else 2 * tokens * fp32 * shape.vocab_size),
                           # chunked, the checkpoints keep the labels to the end of backward
                           labels_copy=0 if chunk else tokens * 8 + (8 if b == 1 else 0),
                           layer_temporaries=temporaries,
                           checkpoint_args=checkpoint_args, autocast_cache=cache,
                           logits=(chunk or tokens) * shape.vocab_size * (a + (fp32 if a < fp32 else 0))
                           + chunk * fp32 * shape.vocab_size)


def activation_bytes(shape: ModelShape, setup: TrainingSetup) -> float:
    """Activation bytes of one training step per GPU: what the forward pass saves for backward, or,
    with checkpointing, the peak of the step (`activation_terms(...).peak`).

    Without checkpointing the figure is what the forward pass saves (`ActivationTerms.saved`), which
    is what stays alive from forward into backward and what lab 1 measures with saved-tensor hooks; the
    start of backward adds the loss's gradients to it (`activation_terms(...).start_of_backward`).
    With checkpointing what is saved in forward and what a recomputed segment saves are never alive
    together, so their sum would be neither a peak nor a phase: the figure is the largest phase, the
    start of backward (segment inputs, the head, the loss's two fp32 gradients of b x s x vocab) or
    the backward of the last segment (segment inputs, its k layers rebuilt, the gradients of the last
    layer's MLP backward), or, under autocast, the end of forward, where autocast's cache holds every
    layer's 16-bit weights. Chapter 6 derives them; lab 6 and the tests measure them with live tensor
    bytes, to the byte in fp32 and 16-bit models on a CPU.
    """
    terms = activation_terms(shape, setup)
    return terms.peak if setup.checkpointing else terms.saved


def torch_sequence_parallel_extra_bytes(shape: ModelShape, setup: TrainingSetup) -> float:
    """Activation bytes PyTorch's `SequenceParallel` plan keeps on top of `activation_bytes`.

    Its `PrepareModuleInput` all-gathers each block's input before the projections read it, and the
    projections save that gathered tensor for backward: the whole of the norm outputs that Megatron-LM
    keeps as 1/t shards, so 1 - 1/t of them more per layer. Zero without sequence parallelism; with
    checkpointing, only the layers of the segment being recomputed hold it.
    """
    t = setup.tp_degree
    if not setup.sequence_parallel or t == 1 or not setup.seq_len:
        return 0.0
    prec = get_precision(setup.precision)
    if prec.weight_copy_bytes > 0:  # autocast: q, k, v and gate, up each keep a 16-bit copy of the input
        per_token = 5 * prec.act_bytes * shape.hidden_size
    else:  # the attention block's and the MLP's gathered input, one tensor each
        per_token = 2 * prec.weight_bytes * shape.hidden_size
    layers = min(setup.checkpoint_every, shape.num_layers) if setup.checkpointing else shape.num_layers
    return layers * setup.batch_size * setup.seq_len * per_token * (1 - 1 / t)


def tp_local_shapes(shape: ModelShape, t: int) -> list[tuple[int, ...]]:
    """Each parameter tensor's shape on tensor-parallel rank 0 (the largest share when t does not divide).

    Column-parallel (q, k, v, gate, up) and the LM head split their rows, row-parallel (o, down) their
    columns, the embedding its vocabulary rows; norms are whole on every rank.
    """
    def part(n: int) -> int:
        return -(-n // t)

    h = shape.hidden_size
    layer: list[tuple[int, ...]] = []
    for name, (out_f, in_f) in shape.linear_shapes().items():
        layer.append((out_f, part(in_f)) if name in ("o_proj", "down_proj") else (part(out_f), in_f))
    shapes: list[tuple[int, ...]] = [(part(shape.vocab_size), h)]
    for _ in range(shape.num_layers):
        shapes += layer + [(h,), (h,)]
    shapes.append((h,))
    if not shape.tie_embeddings:
        shapes.append((part(shape.vocab_size), h))
    return shapes


def kv_cache_bytes(shape: ModelShape, context: int, batch: int, elem_bytes: int) -> int:
    """K and V for every layer, kv head and cached token: 2 x batch x layers x kv_heads x head_dim x context."""
    return 2 * batch * shape.num_layers * shape.num_kv_heads * shape.head_dim * context * elem_bytes


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _lora_params(shape: ModelShape, rank: int, targets: tuple[str, ...]) -> tuple[int, list[tuple[int, ...]]]:
    """Trainable parameters of LoRA adapters: A (r x in) and B (out x r) per targeted projection."""
    tensors: list[tuple[int, ...]] = []
    for name, (out_f, in_f) in shape.linear_shapes().items():
        if name in targets:
            tensors += [(rank, in_f), (out_f, rank)]
    tensors = tensors * shape.num_layers
    return sum(a * b for a, b in tensors), tensors


def _tensor_parallel_share(shape: ModelShape | None, num_params: float, setup: TrainingSetup,
                           notes: list[str]) -> tuple[list[tuple[int, ...]] | None, float]:
    """(parameter shapes on one GPU, or None for a bare count; parameters on one GPU) under `tp_degree`."""
    t = setup.tp_degree
    if t == 1:
        return (shape.param_tensor_shapes() if shape else None), num_params
    if setup.sequence_parallel:
        notes.append("sequence parallel: norms and residual stream split on the sequence")
    if shape is None:
        notes.append(f"tensor parallel t={t} on a parameter count: every parameter divided by {t} "
                     f"(norms are whole on every GPU in practice)")
        return None, num_params / t
    if shape.num_heads % t or shape.num_kv_heads % t:
        raise ValueError(f"tensor parallelism splits whole heads: tp_degree {t} must divide the "
                         f"{shape.num_heads} query and {shape.num_kv_heads} KV heads")
    shapes = tp_local_shapes(shape, t)
    notes.append(f"tensor parallel t={t}: projections, embedding and LM head split {t} ways, norms whole")
    return shapes, float(sum(_numel(s) for s in shapes))


def step_moments(shape: ModelShape | None, setup: TrainingSetup, trainable: float, gradients: float,
                 optimizer_temporaries: float, buckets: float = 0.0,
                 fsdp: FsdpWhole | None = None) -> dict[str, float]:
    """Bytes alive at each moment of a training step that can hold its peak, beyond the weights, the
    optimizer states and the KV cache (which are alive all through), per GPU.

    Backward makes the gradients from the LM head down to the embedding while it frees the
    activations from the top layer down, and `zero_grad(set_to_none=True)` frees the gradients after
    the optimizer step. So the candidates are:
    - the end of forward and the start of backward (`ActivationTerms`' phases): no gradient yet, or
      all of them from the second micro-batch on when `grad_accumulation` > 1;
    - the backward of the top layer (or segment), with the LM head's and final norm's gradients;
    - the backward of the bottom one, where the units above have freed what they saved and made their
      gradients. Per unit both change by fixed amounts, so the most in between lies at one of the two;
    - the embedding's backward, last: every gradient, and the embedding's new one on top while it is
      added to the gradient already there (with tied embeddings the LM head's share waits in autograd's
      buffer until then, and the sum of the two is a third table);
    - with accumulation and an untied LM head, the head's backward: every gradient, and its new one
      while it is added to the old;
    - the optimizer step: every gradient, and the step's temporaries.
    `trainable` is the trainable parameters on this GPU, `gradients` their gradients' bytes, `buckets`
    what is alive at every moment besides (DDP's gradient buckets), `fsdp` what FSDP2 holds whole under
    ZeRO-3 or ZeRO-2 (`_fsdp_moments`). A layer's own gradients while its backward runs and per-tensor
    temporaries are not counted, except under FSDP2, which keeps them whole until the layer's
    reduce-scatter.
    """
    moments = _step_moments(shape, setup, trainable, gradients, optimizer_temporaries, fsdp)
    return {moment: value + buckets for moment, value in moments.items()}


def _step_moments(shape: ModelShape | None, setup: TrainingSetup, trainable: float, gradients: float,
                  optimizer_temporaries: float, fsdp: FsdpWhole | None = None) -> dict[str, float]:
    moments = {"optimizer step": gradients + optimizer_temporaries}
    if shape is None or not setup.seq_len:
        return moments
    terms = activation_terms(shape, setup)
    units = terms.segments or shape.num_layers
    unit = "segment" if terms.segments else "layer"
    accumulating = setup.grad_accumulation > 1
    per_param = gradients / trainable if trainable else 0.0
    full = not setup.lora_rank
    table = shape.vocab_size * shape.hidden_size / setup.tp_degree * per_param if full else 0.0
    # the embedding's gradient, while it is added: its own table, plus, when tied, the LM head's and the sum
    moments["backward of the embedding"] = gradients + (
        (2 + accumulating) * table if shape.tie_embeddings else accumulating * table)
    if accumulating or get_optimizer(setup.optimizer).fused_update:
        before, top, per_unit = gradients, gradients, 0.0  # alive all through backward
    else:
        # the LM head's weight (the embedding's, when tied) and the final norm get theirs first
        head = table + (shape.hidden_size * per_param if full else 0.0)
        embedding = 0.0 if shape.tie_embeddings else table
        before, top = 0.0, head
        per_unit = (gradients - head - embedding) / units
    unit_saves = terms.input if terms.segments else terms.layer
    moments["end of forward"] = terms.end_of_forward + before
    moments["start of backward"] = terms.start_of_backward + before
    tokens = setup.batch_size * setup.seq_len
    if full and 0 < setup.loss_chunk_tokens < tokens:
        # a chunked loss runs the LM head once per chunk, so its weight's gradient is summed in
        # backward: from the second chunk on, the sum so far is alive with the chunk's logits, and
        # when the chunk's share is added, the sum so far, the share and their sum are (not the logits)
        moments["start of backward"] += table
        logits = 3 * setup.loss_chunk_tokens * shape.vocab_size * 4
        moments["summing the LM head's gradient"] = terms.start_of_backward - logits + 3 * table + before
    elif full and accumulating and not shape.tie_embeddings:
        # from the second micro-batch on, the LM head's new gradient is made beside the one summed so
        # far; then the log-softmax is freed, and the logits' gradient (in the logits' dtype) and the
        # hidden states' are alive
        a = get_precision(setup.precision).act_bytes
        moments["backward of the LM head"] = (terms.start_of_backward - terms.loss_gradients
                                              - tokens * shape.vocab_size * (4 - a)
                                              + tokens * shape.hidden_size * a + table + before)
    moments[f"backward of the top {unit}"] = terms.backward_of_layers + top
    moments[f"backward of the bottom {unit}"] = (terms.backward_of_layers - (units - 1) * unit_saves + top
                                                 + (units - 1) * per_unit)
    if fsdp is not None:
        _fsdp_moments(moments, fsdp, shape, setup, unit, units, unit_saves, terms.layer, per_unit, gradients)
    return moments


@dataclass(frozen=True)
class FsdpWhole:
    """What ZeRO-3 holds whole (unsharded) during a step, per GPU, in bytes: the root's parameters and
    gradients, the LM head's gradient (one vocabulary-by-hidden table), and one layer's parameters and
    gradients."""

    root: float
    root_grads: float
    head_table: float
    layer: float
    layer_grads: float


def fsdp_whole_bytes(shape: ModelShape, setup: TrainingSetup, unsharded_param_bytes: float,
                     unsharded_grad_bytes: float, root_elem: float, root_grad_elem: float) -> FsdpWhole:
    """The sizes `step_moments` needs for ZeRO-3 as PyTorch's FSDP2 runs it, with every decoder layer a
    unit (`fully_shard(layer)`) and the root (`fully_shard(model)`) holding the embedding, the final
    norm and the LM head. `unsharded_param_bytes` and `unsharded_grad_bytes` are the whole model's on
    this GPU (its tensor-parallel share); `root_elem` and `root_grad_elem` the bytes per element of the
    root's parameters and gradients (0 when they are frozen)."""
    t = setup.tp_degree
    root_params = shape.embedding_params / t + shape.hidden_size
    root, root_grads = root_params * root_elem, root_params * root_grad_elem
    return FsdpWhole(
        root=root, root_grads=root_grads,
        head_table=shape.vocab_size * shape.hidden_size / t * root_grad_elem,
        layer=(unsharded_param_bytes - root) / shape.num_layers,
        layer_grads=(unsharded_grad_bytes - root_grads) / shape.num_layers,
    )


def _fsdp_moments(moments: dict[str, float], fsdp: FsdpWhole, shape: ModelShape, setup: TrainingSetup,
                  unit: str, units: int, unit_saves: float, layer_saves: float, per_unit: float,
                  gradients: float) -> None:
    """Add what FSDP2 holds whole to each moment, as the allocator's events in traces of its steps show:

    - the root's parameters are gathered as forward starts and kept through backward (resharded after
      forward when asked, they are gathered again as backward starts); its gradients stay whole until
      its reduce-scatter, after the embedding's backward: the LM head's from its backward on, with tied
      embeddings the head's share, the embedding's and their sum;
    - a layer's parameters arrive in the all-gather's buffer and are copied into the layer's own (G
      each). Forward keeps the buffer until the next layer has copied out of its own (torch 2.14 and
      earlier: `wait_for_unshard` drops the last reference after that copy; 2.15 frees it before), the
      top layer's until forward ends; backward frees it after the copy. As backward starts, the root
      gathers the top layer; each layer, once its own are copied, gathers the next one down
      (`_backward_prefetch`); the bottom layer gathers nothing. A checkpointed segment's recomputation
      gathers all its k layers, and each stays gathered until its own backward ends: (k + 1) G as it
      starts, k G after its top layer;
    - a layer's gradients are whole (R) when its backward ends, when what it saved is freed (without
      ZeRO the calculator leaves a layer's own gradients out; here they are a whole layer's); they go
      into the reduce-scatter's input, as big, which lives until the next reduce-scatter starts:
      through the backward of the layer below, and of the embedding.
    Activations shrink and gradient shards grow from unit to unit, so the most is at the top or
    bottom unit or at the ones next to them. Segments are counted as long as the first one (the
    last may be shorter).

    Under ZeRO-2 (`reshard_after_forward=False`) no layer is resharded after its forward or gathered in
    backward: each keeps its parameters from its forward to the end of its backward. Forward's most is
    then as the top layer copies its parameters out of the all-gather's buffer, the layer below's buffer
    still alive up to torch 2.14 (2.15 has freed it, `setup.torch_version`); backward's, at a unit's
    backward, that unit and every one below it gathered.
    """
    G, R, n = fsdp.layer, fsdp.layer_grads, setup.world_size
    k = min(setup.checkpoint_every, shape.num_layers) if setup.checkpointing else 1  # layers per unit
    accumulating = setup.grad_accumulation > 1
    # ZeRO-2 (reshard_after_forward=False): every layer stays gathered from its forward to its backward
    kept = setup.zero_stage == 2
    L = shape.num_layers
    # the LM head's gradient is whole from its backward on, beyond the shard the moments count
    head = fsdp.head_table * (1 - 1 / n)
    chunked = 0 < setup.loss_chunk_tokens < setup.batch_size * setup.seq_len
    if kept:
        # the top layer's forward copies its parameters out of its all-gather's buffer (up to torch 2.14
        # while the layer below's buffer is still alive): every layer's own and one or two buffers, beside
        # what the layers below saved, the top layer's input and the gradients already there (accumulating)
        buffers = 1 if setup.fsdp2_frees_buffer_first else 2
        terms = activation_terms(shape, setup)
        below = terms.kept - (terms.head - terms.ids) - (0.0 if terms.segments else terms.layer - terms.input)
        moments["forward of the top layer"] = (moments["end of forward"] - terms.end_of_forward + below
                                               + fsdp.root + (L + buffers) * G)
    gathered = L * G if kept else G  # as backward starts (ZeRO-3: the top layer, which the root gathers)
    # as forward ends, the top layer's all-gather buffer is still alive (ZeRO-2: beside every layer's own)
    moments["end of forward"] += fsdp.root + gathered + (G if kept else 0.0)
    moments["start of backward"] += fsdp.root + gathered + (head if chunked else 0.0)
    if "backward of the LM head" in moments:
        moments["backward of the LM head"] += fsdp.root + gathered + head
    if "summing the LM head's gradient" in moments:
        moments["summing the LM head's gradient"] += fsdp.root + gathered + 3 * head
    held = fsdp.root + head

    def layer(before: float, above: float, below: int, gathered_after: float) -> float:
        # as the unit's backward starts (its layers gathered, and one more; ZeRO-2: its and all below,
        # `below` layers), or when its top layer's backward ends: what that layer saved or rebuilt
        # freed, its gradients whole
        if kept:
            return held + above + (k + below) * G + max(before, before - layer_saves + R)
        return held + above + max(before + (k + 1) * G, before - layer_saves + gathered_after + R)

    top, bottom = moments[f"backward of the top {unit}"], moments[f"backward of the bottom {unit}"]
    moments[f"backward of the top {unit}"] = layer(top, 0.0, L - k, max(k, 2) * G)
    moments[f"backward of the bottom {unit}"] = layer(bottom, R, 0, k * G)  # it prefetches nothing
    if units >= 3:
        moments[f"backward of the {unit} below the top"] = layer(top - unit_saves + per_unit, R, max(L - 2 * k, 0),
                                                                 max(k, 2) * G)
        moments[f"backward of the {unit} above the bottom"] = layer(bottom + unit_saves - per_unit, R, k,
                                                                    max(k, 2) * G)
    # the embedding's backward: the root gathered, its gradients whole (and with tied embeddings the
    # head's share and the embedding's beside their sum, with accumulation the new one beside the old),
    # the bottom layer's reduce-scatter input; then the root's own reduce-scatter, its parameters freed
    tables = (2 + accumulating) if shape.tie_embeddings else accumulating
    moments["backward of the embedding"] = gradients - fsdp.root_grads / n + max(
        fsdp.root + R + fsdp.root_grads + tables * fsdp.head_table, 2 * fsdp.root_grads)


def estimate(model: Model, setup: TrainingSetup | None = None) -> MemoryEstimate:
    """Memory per GPU for training `model` (a `ModelShape`, or a parameter count) as `setup` says."""
    setup = setup or TrainingSetup()
    prec: Precision = get_precision(setup.precision)
    opt = get_optimizer(setup.optimizer)
    shape = model if isinstance(model, ModelShape) else None
    if isinstance(model, ModelShape):
        num_params = float(model.num_params)
    else:
        if isinstance(model, bool) or not isinstance(model, (int, float)) or model <= 0:
            raise ValueError(f"model must be a ModelShape or a positive parameter count, got {model!r}")
        if setup.lora_rank or setup.quantization or setup.seq_len or setup.kv_cache_len:
            raise ValueError("LoRA, quantization, activations and the KV cache need a model shape, not a count")
        num_params = float(model)
    notes: list[str] = []

    # Frozen and trainable weights.
    train_shapes: list[tuple[int, ...]] | None
    if setup.lora_rank:
        assert shape is not None
        trainable, train_shapes = _lora_params(shape, setup.lora_rank, setup.lora_targets)
        frozen_elem = 4 if prec.name == "fp32" else 2
        linear = shape.num_layers * shape.layer_linear_params()
        if setup.quantization:
            per = quantized_bytes_per_param(setup.quantization, setup.double_quant)
            frozen = linear * per + (num_params - linear) * frozen_elem
            if setup.quantization == "int8":
                frozen += shape.num_layers * sum(o for o, _ in shape.linear_shapes().values()) * 4
        else:
            frozen = num_params * frozen_elem
        param_bytes = frozen + trainable * prec.weight_bytes
        held = float(trainable)  # trainable parameters on this GPU
        notes.append(f"LoRA r={setup.lora_rank}: {trainable:,} trainable of {num_params + trainable:,.0f}")
    else:
        if setup.quantization:
            raise ValueError("quantized base weights are frozen: set lora_rank to train adapters (QLoRA)")
        trainable = int(num_params)
        train_shapes, held = _tensor_parallel_share(shape, num_params, setup, notes)
        param_bytes = held * prec.weight_bytes

    grad_bytes = float(held * prec.grad_bytes)
    if opt.fused_update:
        # the update runs as each gradient is ready and the gradient is freed: at most the largest
        # tensor's gradient exists at a time
        grad_bytes = float(max(_numel(t) for t in train_shapes) * prec.grad_bytes) if train_shapes else 0.0
        notes.append(f"{opt.name}: updates in backward, no full set of gradients kept")
    opt_bytes = held * prec.master_bytes + optimizer_state_bytes(opt, prec, train_shapes, held)

    # ZeRO: stage 1 shards optimizer states, 2 also gradients, 3 also the weights.
    n = setup.world_size
    if setup.zero_stage >= 1:
        opt_bytes /= n
    if setup.zero_stage >= 2:
        grad_bytes /= n
    if setup.zero_stage >= 3:
        param_bytes /= n
    if setup.zero_stage and n == 1:
        notes.append("ZeRO with one GPU shards nothing")
    # the optimizer step's temporaries come from the states of the parameters this GPU updates
    shard = n if setup.zero_stage >= 1 else 1
    temporaries = opt.step_temporaries * held * prec.state_bytes / shard
    if prec.master_bytes and not opt.fused_update:
        notes.append(f"mixed precision: the optimizer step is counted for an update that reads the 16-bit "
                     f"gradients; DeepSpeed's ZeRO optimizer first copies them (its shard) to fp32: "
                     f"+{held * 4 / shard / 1e9:.3f} GB at the step; Megatron-LM with bf16 keeps its gradients "
                     f"in fp32 through backward: 2 more bytes per parameter")
    # DDP copies every gradient into its buckets, which live through the whole step
    # (gradient_as_bucket_view=False, its default; True makes the gradients views of them)
    buckets = grad_bytes if n > 1 and setup.zero_stage == 0 else 0.0
    if buckets:
        notes.append("DDP: its buckets hold a copy of every gradient through the step (counted in the peak)")

    acts = activation_bytes(shape, setup) if shape and setup.seq_len else 0.0
    backward_extra = max(0.0, activation_terms(shape, setup).peak - acts) if shape and setup.seq_len else 0.0
    # each tensor-parallel GPU caches the KV heads it computes
    kv = kv_cache_bytes(shape, setup.kv_cache_len, setup.kv_cache_batch, prec.act_bytes) / setup.tp_degree \
        if shape else 0.0
    if shape and setup.tp_degree > 1 and not setup.lora_rank:
        # DTensor computes the embedding's gradient from the replicated token ids as a whole table on
        # every rank and keeps it until the optimizer step (measured: tests/test_tp_peak.py)
        whole = shape.vocab_size * shape.hidden_size * prec.grad_bytes * (1 - 1 / setup.tp_degree)
        notes.append(f"tensor parallel counted as Megatron-LM shards the embedding's gradient; PyTorch's plan "
                     f"keeps it whole on every GPU: +{whole / 1e9:.3f} GB wherever all gradients are alive")
    if shape and setup.seq_len and setup.sequence_parallel and setup.tp_degree > 1:
        extra = torch_sequence_parallel_extra_bytes(shape, setup)
        notes.append(f"sequence parallel counted as Megatron-LM keeps it; PyTorch's SequenceParallel plan "
                     f"keeps the gathered block inputs: +{extra / 1e9:.3f} GB")
    if not setup.seq_len:
        notes.append("activations not counted (no sequence length given)")
    # FSDP2's root (embedding, final norm, LM head): frozen under LoRA, else trained in the policy's dtypes
    root_elem, root_grad_elem = (frozen_elem, 0) if setup.lora_rank else (prec.weight_bytes, prec.grad_bytes)
    fsdp = None
    if setup.zero_stage == 3 and n > 1:
        if shape is None or not setup.seq_len:
            notes.append("ZeRO-3: the layers gathered during forward and backward are counted in the peak only "
                         "with a model shape and a sequence length")
        else:
            fsdp = fsdp_whole_bytes(shape, setup, param_bytes * n, held * prec.grad_bytes, root_elem, root_grad_elem)
            notes.append("ZeRO-3 as FSDP2 runs it: the peak counts the root's and two layers' whole parameters, "
                         "and a layer's whole gradients in its reduce-scatter's input")
            if setup.checkpointing and setup.checkpoint_every > 1:
                notes.append("ZeRO-3 with checkpointed segments of several layers: each segment's layers are "
                             "counted gathered at once, but FSDP2 under gpulab's checkpoint_in_segments was "
                             "measured holding up to 30% more than this peak on a CPU; transformers' "
                             "per-layer checkpointing matches it")
            if setup.grad_accumulation > 1:
                notes.append("ZeRO-3 with accumulation: counted as FSDP2's default, a reduce-scatter after every "
                             "micro-batch; set_requires_gradient_sync(False) keeps every gradient whole between "
                             f"them instead (+{held * prec.grad_bytes * (1 - 1 / n) / 1e9:.3f} GB)")
    fsdp2_zero2_peak = 0.0
    if setup.zero_stage == 2 and n > 1 and shape is not None and setup.seq_len:
        # PyTorch has no DeepSpeed-style stage 2: FSDP2 with reshard_after_forward=False is its ZeRO-2
        fsdp2_whole = fsdp_whole_bytes(shape, setup, param_bytes, held * prec.grad_bytes, root_elem, root_grad_elem)

        def fsdp2_peak(s: TrainingSetup) -> float:
            return param_bytes / n + opt_bytes + kv + max(
                step_moments(shape, s, held, grad_bytes, temporaries, 0.0, fsdp2_whole).values())

        fsdp2_zero2_peak = fsdp2_peak(setup)
        notes.append(f"ZeRO-2 counted as DeepSpeed runs it, the whole parameters on every GPU all the time; "
                     f"FSDP2 with reshard_after_forward=False keeps only their shard between steps, but from a "
                     f"layer's forward to its backward the whole layer, and each layer's gradients whole until "
                     f"its reduce-scatter: peak {fsdp2_zero2_peak / 1e9:.3f} GB")
        if not setup.fsdp2_frees_buffer_first:
            newer_peak = fsdp2_peak(replace(setup, torch_version=FSDP2_FREES_BUFFER_FIRST))
            if newer_peak < fsdp2_zero2_peak:
                notes.append(f"FSDP2 of torch {FSDP2_FREES_BUFFER_FIRST} or later frees each layer's all-gather "
                             f"buffer in forward before the next layer copies out of its own: "
                             f"peak {newer_peak / 1e9:.3f} GB there (counted for torch {setup.torch_version})")
        if setup.checkpointing and setup.checkpoint_every > 1:
            notes.append("ZeRO-2 with checkpointed segments of several layers: FSDP2 under gpulab's "
                         "checkpoint_in_segments was measured holding up to 15% more than its peak above on a "
                         "CPU; transformers' per-layer checkpointing matches it")
    moments = step_moments(shape, setup, held, grad_bytes, temporaries, buckets, fsdp)
    moment = max(moments, key=moments.__getitem__)
    return MemoryEstimate(
        parameters=round(param_bytes),
        gradients=round(grad_bytes),
        optimizer=round(opt_bytes),
        activations=round(acts),
        kv_cache=round(kv),
        trainable_params=int(trainable),
        backward_extra=round(backward_extra),
        peak=round(param_bytes + opt_bytes + kv + moments[moment]),
        peak_moment=moment,
        notes=tuple(notes),
        fsdp2_zero2_peak=round(fsdp2_zero2_peak),
    )
