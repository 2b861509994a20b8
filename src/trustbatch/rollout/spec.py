"""Engines declared, not copied: an ``EngineSpec`` says how a run samples, ``make_engine`` builds one from it.

Every engine of the package is built here: the training rollout engine, the held-out evaluation's, the foreign
model's, each rollout worker's and ``trustbatch eval``'s. An engine registers under its name with what its
builder needs (``register_engine``); the vLLM engine's module is imported only when one is built (vLLM is an
optional extra). A new sampling backend is one more registration, never a branch in a caller.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import UserError
from .engine import Engine


@dataclass(frozen=True)
class EngineSpec:
    """How an engine samples, as plain values (picklable: a rollout worker builds its own engine from it).

    name: a registered engine (``transformers``, ``vllm``). precision: the behaviour copy's dtype or quantization
    (``rollout.shifts``; vLLM: its ``dtype``). quantization: vLLM's online quantization, or None. seed: the vLLM
    engine's sampling seed. threads: intra-op threads the vLLM engine sets (None: leave them). record: an engine
    that declares ``recorded`` at this precision records each step's whole distribution (``Rollout.
    behavior_logprobs_full``), one that declares ``top_k`` its ``top_k`` largest log-probs (``Rollout.
    behavior_top_logprobs``); set only where an objective needs it (kl="exact"), as it is V (k) times the log-probs.
    top_k: that k (``rollout.logprobs_top_k``).
    decode: the transformers engine's decoding loop (``rollout.static_decode.DECODES``; ``TransformersEngine``).
    noise: its per-completion random streams (``rollout.gumbel.NOISES``).
    """

    name: str = "transformers"
    precision: str = "float32"
    quantization: str | None = None
    seed: int = 0
    threads: int | None = None
    record: bool = False
    top_k: int = 20
    decode: str = "dynamic"
    noise: str = "generator"


# What an engine can hand the learner of the distribution it sampled from, beyond the sampled tokens' log-probs:
# "full": the whole distribution, rebuilt by the learner from the engine's ``teacher`` (faithful: teacher forcing
# gives the distribution decoding sampled from, up to round-off); "recorded": the whole distribution, recorded at
# each decoding step (where teacher forcing is not faithful: it rebuilds another distribution), [N, steps, V]
# float32 per round; "top_k": its top-k log-probs per token, k = ``EngineSpec.top_k`` (the exact KL becomes the lower
# bound ``objectives.kl.top_k_kl_lower_bound``); "none": nothing more.
BEHAVIOUR_DISTRIBUTIONS = ("full", "recorded", "top_k", "none")
WHOLE_DISTRIBUTIONS = ("full", "recorded")  # what an exact KL can take
KL_DISTRIBUTIONS = (*WHOLE_DISTRIBUTIONS, "top_k")  # what kl="exact" runs with: the KL, or its top-k lower bound


@dataclass(frozen=True)
class _Registered:
    build: Callable[..., Engine]
    check: Callable[[EngineSpec], None]
    shares_module: bool  # can sample from the learner's own float32 module (no copy, no weight transfer)
    behaviour: str  # one of BEHAVIOUR_DISTRIBUTIONS, at every precision not in by_precision
    by_precision: dict  # precision -> one of BEHAVIOUR_DISTRIBUTIONS, where it differs
    min_temperature: float  # the lowest sampling temperature it samples at as given (0: any > 0)
    data_parallel: bool  # runs under several data-parallel ranks (torchrun), one engine per rank


_ENGINES: dict[str, _Registered] = {}


def register_engine(name: str, *, check: Callable[[EngineSpec], None] = lambda spec: None,
                    shares_module: bool = False, behaviour: str = "none", by_precision: dict | None = None,
                    min_temperature: float = 0.0, data_parallel: bool = True):
    """Register ``build(spec, policy, *, model, model_dir, version, share, autocast, max_model_len, device)``
    as engine ``name``; ``check(spec)`` refuses, before any model loads, a spec it cannot run (``UserError``);
    ``behaviour`` declares what it returns of the sampled distribution (``BEHAVIOUR_DISTRIBUTIONS``), and
    ``by_precision`` what it returns instead at some ``EngineSpec.precision`` values; ``min_temperature`` the
    lowest temperature it samples at as given (``check_temperature``); ``data_parallel`` whether it runs under
    several data-parallel ranks (``check_ranks``)."""
    by_precision = dict(by_precision or {})
    for b in (behaviour, *by_precision.values()):
        if b not in BEHAVIOUR_DISTRIBUTIONS:
            raise ValueError(f"behaviour={b!r} is not one of {BEHAVIOUR_DISTRIBUTIONS}")

    def deco(build):
        _ENGINES[name] = _Registered(build, check, shares_module, behaviour, by_precision, min_temperature,
                                     data_parallel)
        return build

    return deco


def _entry(spec: EngineSpec) -> _Registered:
    try:
        return _ENGINES[spec.name]
    except KeyError:
        raise UserError(f"unknown rollout engine {spec.name!r}; use one of {', '.join(_ENGINES)}") from None


def engine_names() -> tuple[str, ...]:
    """The registered engines' names, in registration order."""
    return tuple(_ENGINES)


def check_engine(spec: EngineSpec) -> None:
    """Every refusal of ``spec`` that needs no model: an unknown engine, an optional one not installed, a precision
    it does not run.

    Raises:
        UserError: one line naming the cause and the fix.
    """
    _entry(spec).check(spec)


def check_temperature(spec: EngineSpec, temperature: float, key: str) -> None:
    """Refuse a sampling temperature below what the engine samples at as given (``register_engine``'s
    ``min_temperature``): it would sample, and record its log-probs, at another temperature than the run says.

    Raises:
        UserError: one line naming ``key`` (the setting: ``rollout.temperature``, ``--temperature``) and the bound.
    """
    low = _entry(spec).min_temperature
    if temperature < low:
        raise UserError(f"{key}={temperature:g} is below the {spec.name} engine's lowest temperature {low:g} (it "
                        f"would sample and record log-probs at {low:g}); set {key} >= {low:g}")


def check_ranks(spec: EngineSpec, ranks: int) -> None:
    """Refuse ``ranks`` > 1 data-parallel ranks for an engine that does not declare it runs under them
    (``register_engine``'s ``data_parallel``).

    Raises:
        UserError: one line naming the engine, the ranks and the fix.
    """
    if ranks > 1 and not _entry(spec).data_parallel:
        raise UserError(f"rollout.engine={spec.name} does not run under {ranks} data-parallel ranks yet (one engine "
                        f"per rank is untested); run one process, or use rollout.engine=transformers under torchrun")


def behaviour_distribution(spec: EngineSpec) -> str:
    """What an engine of ``spec`` (its name and precision) declares it returns of its sampling distribution:
    one of ``BEHAVIOUR_DISTRIBUTIONS``."""
    entry = _entry(spec)
    return entry.by_precision.get(spec.precision, entry.behaviour)


def shares_module(spec: EngineSpec) -> bool:
    """Whether an engine of ``spec`` can sample from the learner's own module (a float32 transformers engine)."""
    return _entry(spec).shares_module and spec.precision == "float32"


def make_engine(spec: EngineSpec, policy, *, model: torch.nn.Module | None = None, model_dir: str | None = None,
                version: int = 0, share: bool | None = None, autocast: torch.dtype | None = None,
                max_model_len: int | None = None, device: torch.device | str | None = None) -> Engine:
    """The engine ``spec`` names, sampling ``model`` (default ``policy.model``) with ``policy``'s EOS and pad ids.

    ``model_dir``: a Hugging Face directory of the model, for an engine that loads one (vLLM; without it the model
    is written to a temporary directory, removed at exit). ``version``: the policy version copied into its
    rollouts until ``load_weights``. ``share``/``autocast``: a transformers engine that samples from the module
    itself, under the learner's autocast dtype (``TransformersEngine``). ``max_model_len``: vLLM's bound on
    prompt + completion tokens (default the model's context). ``device``: where a transformers engine's model runs
    (moved there; None: where it is).

    Raises:
        UserError: ``check_engine``'s refusals; vLLM refusing the model or setting (its first line).
    """
    entry = _entry(spec)
    entry.check(spec)
    return entry.build(spec, policy, model=model, model_dir=model_dir, version=version, share=share,
                       autocast=autocast, max_model_len=max_model_len, device=device)


# Teacher forcing a float32 copy rebuilds the sampled distribution up to round-off; at any other precision it does
# not (measured on stories260K, KL(recorded ‖ rebuilt) in nats/token against the policy shift KL(π_θ ‖ recorded):
# bf16 3.5e-4 vs 3.9e-4, fp8_e4m3 1.3e-2 vs 1.8e-2, int8 5.6e-2 vs 1.8e-2, fp8_e4m3_rowwise 1.5e-4 vs 1.5e-2):
# a whole-sequence forward rounds differently from step-by-step decoding, and int8 / per-tensor FP8 take their
# dynamic scales from the learner's batch instead of each decoding step's rows. There the engine records; a
# precision is rebuilt only where declared faithful (a new precision records until measured).
def _check_transformers(spec: EngineSpec) -> None:
    from .gumbel import NOISES
    from .static_decode import DECODES
    from .transformers_engine import BATCH_SCALED

    if spec.decode not in DECODES:
        raise UserError(f"rollout.decode={spec.decode} is not one of {', '.join(DECODES)}")
    if spec.noise not in NOISES:
        raise UserError(f"rollout.noise={spec.noise} is not one of {', '.join(NOISES)}")
    if spec.decode != "dynamic" and spec.precision in BATCH_SCALED:
        raise UserError(f"rollout.decode={spec.decode} does not run rollout.precision={spec.precision} (its activation "
                        "scales are taken over each forward's whole batch); use rollout.decode=dynamic")
    if spec.quantization is not None:  # read by vLLM alone: the rollouts would stay float32 and on-policy
        raise UserError(f"rollout.quantization={spec.quantization} is vLLM's online quantization, which the "
                        "transformers engine does not run; add rollout.engine=vllm, or use rollout.precision "
                        "(int8, fp8_e4m3, fp8_e4m3_rowwise) for a quantized copy in this engine")


@register_engine("transformers", check=_check_transformers, shares_module=True, behaviour="recorded",
                 by_precision={"float32": "full"})
def _transformers(spec: EngineSpec, policy, *, model, model_dir, version, share, autocast, max_model_len, device):
    from .static_decode import static_decode_unsupported
    from .transformers_engine import TransformersEngine

    model = policy.model if model is None else model
    if device is not None:
        model = model.to(device)
    if spec.decode != "dynamic" and (reason := static_decode_unsupported(model)) is not None:
        raise UserError(f"rollout.decode={spec.decode} cannot run {type(model).__name__}: {reason}; "
                        "use rollout.decode=dynamic")
    return TransformersEngine(model, policy.end_ids, policy.pad_id, precision=spec.precision, share=share,
                              version=version, autocast=autocast,
                              record=spec.record and behaviour_distribution(spec) == "recorded", decode=spec.decode,
                              noise=spec.noise)


def _check_vllm(spec: EngineSpec) -> None:
    for key, value, default in (("decode", spec.decode, "dynamic"), ("noise", spec.noise, "generator")):
        if value != default:
            raise UserError(f"rollout.{key}={value} sets the transformers engine's sampler; vLLM runs its own: "
                            f"drop rollout.{key}, or use rollout.engine=transformers")
    if importlib.util.find_spec("vllm") is None:
        from .vllm_engine import MISSING_VLLM  # imports no vllm

        raise UserError(MISSING_VLLM)
    if spec.precision == "int8":
        raise UserError("rollout.engine=vllm runs in float32, bfloat16 or float16; for 8-bit weights use "
                        "rollout.quantization=fp8_per_channel")


# vLLM returns top-k log-probs per step (SamplingParams.logprobs); the learner cannot rebuild its model's
# distribution (another implementation, its own kernels and quantization), so it takes the top-k lower bound
# vLLM's SamplingParams raises a temperature in (0, 0.01) to its _MAX_TEMP 0.01 (__post_init__), with a log line
@register_engine("vllm", check=_check_vllm, behaviour="top_k", min_temperature=0.01, data_parallel=False)
def _vllm(spec: EngineSpec, policy, *, model, model_dir, version, share, autocast, max_model_len, device):
    if model_dir is None:
        import atexit
        import shutil
        import tempfile

        model_dir = tempfile.mkdtemp(prefix="trustbatch-vllm-model-")
        atexit.register(shutil.rmtree, model_dir, True)
        (policy if model is None else dataclasses.replace(policy, model=model)).save(model_dir)
    if max_model_len is None:  # vLLM needs the bound stated; prompts past the context were dropped by the recipe
        max_model_len = getattr(policy.model.config, "max_position_embeddings", None)
    try:
        from .vllm_engine import VLLMEngine

        return VLLMEngine(model_dir, policy.end_ids, policy.pad_id, precision=spec.precision,
                          quantization=spec.quantization, seed=spec.seed, threads=spec.threads, version=version,
                          max_model_len=max_model_len, top_k=spec.top_k if spec.record else 0)
    except (ImportError, ValueError) as e:
        raise UserError(str(e).splitlines()[0]) from None
