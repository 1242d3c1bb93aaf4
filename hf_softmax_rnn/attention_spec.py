"""One validated description of an attention variant (the presets that name them: `presets`).

`AttentionSpec` is the single schema for the attention choice. Every other part of the
package (ops, layers, model configs, scripts) reads it and never re-validates strings.
It round-trips through a plain dict so that it can live inside a `PretrainedConfig`.

This module imports only the standard library and torch-free code so that it can be
copied flat next to a checkpoint for `trust_remote_code` loading.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hf_softmax_rnn.presets import PRESET_FIELDS
from hf_softmax_rnn.presets import PRESETS as PRESETS

KINDS = ("softmax", "recurrent_softmax", "linear")
FEATURE_MAPS = ("identity", "elu", "relu", "cosine", "taylor", "hedgehog")
NORMALIZERS = (
    "softmax",
    "l2",
    "rms",
    "layer",
    "seqlen",
    "seqlen_rms",
    "seqlen_layer",
    "seqlen_pow",
    "clamp",
    "detach",
    "detach_eps",
    "none",
)
#: Normalisers that ignore a positive per-row factor of the scores (up to eps), so exp may
#: be computed as exp(x - rowmax).
ROW_SCALE_INVARIANT_NORMALIZERS = ("softmax", "l2", "rms", "layer", "seqlen_rms", "seqlen_layer")
#: Normalisers that read the denominator G_t = sum_s score_ts.
DENOMINATOR_NORMALIZERS = ("softmax", "clamp", "detach", "detach_eps")
#: Normalisers with learned parameters (owned by the layer, passed to the ops).
LEARNED_NORMALIZERS = ("rms", "layer", "seqlen_rms", "seqlen_layer", "seqlen_pow")
OUTPUT_GATE_POSITIONS = ("after_norm", "before_norm")
MODES = ("parallel", "chunked", "recurrent")
#: Modes of a forward pass without a cache (training, scoring); "chunked" applies to finite-state layers.
NO_CACHE_MODES = ("parallel", "chunked")

#: Largest recurrent state (numerator + denominator, one KV head, float32) accepted by
#: default; a larger Taylor state raises with its size instead of exhausting memory.
DEFAULT_MAX_STATE_BYTES = 256 * 2**20
#: Bytes of a kept slot's position (int64) and of its filled flag (bool), whatever the state's dtype.
_POSITION_BYTES, _FLAG_BYTES = 8, 1
#: Largest Taylor order accepted: the quadratic form evaluates order + 1 terms per score, so a
#: larger order is refused with this bound instead of a call that does not return.
MAX_TAYLOR_ORDER = 1024


def _choice_error(field: str, value: Any, allowed: tuple) -> ValueError:
    return ValueError(f"AttentionSpec.{field}={value!r} is not allowed; expected one of {list(allowed)}")


def _check_size(name: str, value: Any) -> None:
    """A head size argument is an int >= 1 (a traced size, torch's SymInt, is taken as it is)."""
    if type(value).__name__ == "SymInt":
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r} has type {type(value).__name__}; expected an int >= 1")
    if value < 1:
        raise ValueError(f"{name}={value!r} is not allowed; expected an int >= 1")


def taylor_feature_dim(head_dim: int, order: int) -> int:
    """Size of the Taylor feature map phi_N in the symmetric monomial basis:
    sum_{n<=N} C(d+n-1, n) = C(d+N, N) (d=64: 1 + 64 + 2080 for N = 2)."""
    return math.comb(head_dim + order, order)


@dataclass(frozen=True)
class AttentionSpec:
    """The attention variant of one layer: validated once, at construction, and frozen (a changed copy is
    `dataclasses.replace(spec, window=8)`, which validates it).

    Attributes:
        kind: "softmax" (exact softmax, SDPA), "recurrent_softmax" (exp(q.k) or its Taylor
            truncation, with any normaliser) or "linear" (phi(q).phi(k) with a feature map).
        taylor_order: for recurrent_softmax, None = exact exp, N >= 0 = exp truncated at
            order N (a finite RNN). For linear with feature_map="taylor", the order of phi_N.
        feature_map: for linear only: identity, elu (elu+1), relu, cosine, taylor, hedgehog.
        normalizer: how N_t (the numerator) becomes the output; see NORMALIZERS and docs/design.md.
        score_clamp: exp(min(x, c)) (or kernel clamped at c); None = no clamp.
        input_gate: a sigmoid gate from the layer input on the values (docs/design.md).
        output_gate: a sigmoid gate from the layer input on the output (docs/design.md).
        output_gate_position: "after_norm" (default) or "before_norm" (inert before an
            invariant norm, kept for the paper's ablation).
        chunk_size: chunk length C of the chunked mode.
        qk_scale: multiplier of q.k (or phi(q).phi(k)); None = 1/sqrt(head_dim). The linear
            elu, relu and cosine presets set 1.0: the authors applied no scale there.
        hedgehog_dim: feature width of the hedgehog map before the [Wx, -Wx] doubling;
            None = head_dim.
        norm_eps: epsilon of the l2, rms and layer normalisers.
        window: W for a sliding-window hybrid: the last W positions (the query's own included)
            are scored with the exact exp(q.k), older ones with the finite-state kernel, under one
            normaliser (finite-state kernels and row-scale-invariant normalisers only); None = no
            window. Decoding keeps the W keys and values beside the recurrent state. With
            kind="softmax": sliding-window softmax, the last W positions (by index, padding included, as
            transformers' sliding-window layers count them) and nothing older.
        sinks: S attention sinks: the first S visible (non-padding) positions are also scored with
            the exact exp(q.k), under the window's normaliser and row shift, and never enter the
            finite state (a key both in the window and a sink counts once); needs a `window`;
            None = no sinks. Decoding keeps the S keys and values beside the window's.
        decay: a data-dependent forget gate on the finite-state part: the state is multiplied by
            a_t = sigmoid(w_h . x_t + b_h) in (0, 1) per position and KV head before the key that
            enters at t is added (with a window, a key enters when it leaves the window). The
            layer computes log a_t and passes it as gates["decay"]. See docs/decay.md.
        kept: K positions older than the window also scored with the exact exp(q.k): those that the
            queries of their window attended to most (each key's largest window-softmax weight over
            the W queries that see it in their window, or its predecessor's if larger), kept while
            they rank among the K highest of the positions that have left the window; a key enters
            the finite state only when it is not kept (when it leaves the window, or later, when a
            higher-ranked key displaces it).
            Needs a `window`; None = none. Decoding keeps the K keys and values beside the window's.
            See docs/kept.md.
        delta_rule: the finite state is corrected toward each entering value instead of only added to
            (DeltaNet): with unit key features u_s = phi(k_s) / |phi(k_s)| and a write strength b_t in
            (0, 1) per position and KV head (`gates["delta"]`), S_t = a_t (I - b_t u_s u_s^T) S_{t-1} +
            b_t phi(k_s) [v_s, 1]^T for the key s that enters at step t (with `decay`, the gated delta
            rule; a_t = 1 without). Keys that never share a direction add up as in linear attention when
            b_t = 1; a key that repeats overwrites its value. See docs/delta_rule.md.
        additive_mass: a delta-rule state that recalls values and weighs them by an additive mass: its
            value columns are corrected toward v itself (S^T u_s -> v_s) and read by the query's direction,
            y = (phi(q) / |phi(q)|) S, while its last column is the additive sum z_a = sum_s a phi(k_s)
            (no correction, no write strength); the finite part is m [y, 1] with m = phi(q).z_a, the weight
            an additive state gives the keys it holds. Beside a window the recall then weighs as much as the
            positions it stands for, and without a window the normaliser reads the additive denominator.
            The state keeps its size. Needs `delta_rule`. See docs/delta_rule.md.
        short_conv: K for a short causal convolution over the keys and values: each channel of each KV
            head becomes a learned combination of its last K positions (the query's own included) before
            attention, so a key can carry what came just before it (DeltaNet's short convolution; weights
            per KV head and channel, starting as the identity, so a converted model starts as it was). Needs
            a finite-state spec; decoding keeps the last K - 1 keys and values before the convolution. None
            = none. See docs/short_conv.md.
    """

    kind: str = "softmax"
    taylor_order: int | None = None
    feature_map: str | None = None
    normalizer: str = "softmax"
    score_clamp: float | None = None
    input_gate: bool = False
    output_gate: bool = False
    output_gate_position: str = "after_norm"
    chunk_size: int = 64
    qk_scale: float | None = None
    hedgehog_dim: int | None = None
    norm_eps: float = 1e-6
    window: int | None = None
    sinks: int | None = None
    decay: bool = False
    kept: int | None = None
    delta_rule: bool = False
    additive_mass: bool = False
    short_conv: int | None = None

    def __post_init__(self) -> None:
        self._take_numpy_scalars()
        self._validate()

    def _take_numpy_scalars(self) -> None:
        """A NumPy scalar in a number field (np.float32(5.0), np.int64(4), as a config read with NumPy holds them)
        becomes the Python number it equals, so that the spec compares, hashes and saves as with that number; a
        NumPy bool stays as it is and is refused by the type check, as are arrays."""
        for name, allowed, _ in _FIELD_TYPES:
            value = getattr(self, name)
            if type(value).__module__ != "numpy" or not isinstance(value, numbers.Real):  # (not an array)
                continue
            if int in allowed and isinstance(value, numbers.Integral):
                object.__setattr__(self, name, int(value))
            elif float in allowed:
                object.__setattr__(self, name, float(value))

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        self._check_types()
        if self.kind not in KINDS:
            raise _choice_error("kind", self.kind, KINDS)
        if self.normalizer not in NORMALIZERS:
            raise _choice_error("normalizer", self.normalizer, NORMALIZERS)
        if self.output_gate_position not in OUTPUT_GATE_POSITIONS:
            raise _choice_error("output_gate_position", self.output_gate_position, OUTPUT_GATE_POSITIONS)
        if self.output_gate_position != "after_norm" and not self.output_gate:
            raise ValueError(
                f"AttentionSpec.output_gate_position={self.output_gate_position!r} is not allowed with "
                "output_gate=False (there is no output gate to place); expected 'after_norm' (the default), or "
                "output_gate=True"
            )
        if self.feature_map is not None and self.feature_map not in FEATURE_MAPS:
            raise _choice_error("feature_map", self.feature_map, FEATURE_MAPS)
        if self.taylor_order is not None and (
            not isinstance(self.taylor_order, int)
            or isinstance(self.taylor_order, bool)
            or not 0 <= self.taylor_order <= MAX_TAYLOR_ORDER
        ):
            raise ValueError(
                f"AttentionSpec.taylor_order={self.taylor_order!r} is not allowed; expected None or an int from 0 to "
                f"{MAX_TAYLOR_ORDER} (the quadratic form evaluates taylor_order + 1 terms per score; the state of "
                "order N has C(head_dim + N, N) features)"
            )
        if not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise ValueError(f"AttentionSpec.chunk_size={self.chunk_size!r} is not allowed; expected an int >= 1")
        if self.score_clamp is not None and not math.isfinite(self.score_clamp):
            raise ValueError(
                f"AttentionSpec.score_clamp={self.score_clamp!r} is not allowed; expected None or a finite float"
            )
        if self.qk_scale is not None and not (math.isfinite(self.qk_scale) and self.qk_scale > 0):
            raise ValueError(f"AttentionSpec.qk_scale={self.qk_scale!r} is not allowed; expected None or a float > 0")
        if self.hedgehog_dim is not None and (not isinstance(self.hedgehog_dim, int) or self.hedgehog_dim < 1):
            raise ValueError(
                f"AttentionSpec.hedgehog_dim={self.hedgehog_dim!r} is not allowed; expected None or an int >= 1"
            )
        if not (math.isfinite(self.norm_eps) and self.norm_eps > 0):
            raise ValueError(f"AttentionSpec.norm_eps={self.norm_eps!r} is not allowed; expected a finite float > 0")
        if self.window is not None and self.window < 1:
            raise ValueError(f"AttentionSpec.window={self.window!r} is not allowed; expected None or an int >= 1")

        if self.kind == "softmax":
            for name, default in (
                ("feature_map", None),
                ("taylor_order", None),
                ("score_clamp", None),
                ("input_gate", False),
                ("output_gate", False),
            ):
                if getattr(self, name) != default:
                    raise ValueError(
                        f"AttentionSpec.{name}={getattr(self, name)!r} is not allowed with kind='softmax' "
                        f"(exact softmax has no {name}); expected {default!r}, or use kind='recurrent_softmax'"
                    )
            if self.normalizer != "softmax":
                raise ValueError(
                    f"AttentionSpec.normalizer={self.normalizer!r} is not allowed with kind='softmax'; expected "
                    "'softmax', or use kind='recurrent_softmax' to replace the denominator"
                )
        elif self.kind == "recurrent_softmax":
            if self.feature_map is not None:
                raise ValueError(
                    f"AttentionSpec.feature_map={self.feature_map!r} is not allowed with kind='recurrent_softmax' "
                    "(its kernel is exp or its Taylor truncation); expected None, or use kind='linear'"
                )
        else:
            if self.feature_map is None:
                raise ValueError(
                    "AttentionSpec.feature_map=None is not allowed with kind='linear'; expected one of "
                    f"{list(FEATURE_MAPS)}"
                )
            if self.feature_map == "taylor" and self.taylor_order is None:
                raise ValueError(
                    "AttentionSpec.taylor_order=None is not allowed with feature_map='taylor'; expected an int >= 0"
                )
            if self.feature_map != "taylor" and self.taylor_order is not None:
                raise ValueError(
                    f"AttentionSpec.taylor_order={self.taylor_order!r} is not allowed with "
                    f"feature_map={self.feature_map!r}; "
                    "expected None (only feature_map='taylor' has an order)"
                )
        if self.hedgehog_dim is not None and self.feature_map != "hedgehog":
            raise ValueError(
                f"AttentionSpec.hedgehog_dim={self.hedgehog_dim!r} is not allowed with "
                f"feature_map={self.feature_map!r}; expected None"
            )
        if self.window is not None:
            self._validate_window()
        if self.sinks is not None:
            self._validate_beside_window("sinks", "sinks are the first positions")
        if self.kept is not None:
            self._validate_beside_window("kept", "kept positions are older positions")
        if self.decay and not self.has_finite_state:
            raise ValueError(
                f"AttentionSpec.decay=True is not allowed with {self.describe()}: the forget gate decays the finite "
                "recurrent state, which this spec does not have; expected decay=False, or a finite-state spec "
                "(kind='linear', or kind='recurrent_softmax' with a taylor_order, and no score_clamp)"
            )
        if self.delta_rule:
            self._validate_delta_rule()
        elif self.additive_mass:
            raise ValueError(
                "AttentionSpec.additive_mass=True is not allowed with delta_rule=False: it weighs a delta-rule "
                "state's recall by an additive mass, and an additive state is its own mass; expected "
                "additive_mass=False, or delta_rule=True"
            )
        if self.short_conv is not None:
            self._validate_short_conv()
        if self.normalizer in DENOMINATOR_NORMALIZERS and self.uses_taylor and self.taylor_order % 2 == 1:
            warnings.warn(
                f"AttentionSpec.taylor_order={self.taylor_order} is odd: an odd truncation of exp is negative for "
                f"some scores, so normalizer={self.normalizer!r} can divide by ~0. Use an even order or "
                "normalizer='l2'.",
                stacklevel=3,
            )

    def _check_types(self) -> None:
        """Each field has its declared type (a config.json with "false" or 2.0 in it raises here)."""
        for name, allowed, words in _FIELD_TYPES:
            value = getattr(self, name)
            if isinstance(value, bool) and bool not in allowed or not isinstance(value, allowed):
                raise TypeError(f"AttentionSpec.{name}={value!r} has type {type(value).__name__}; expected {words}")

    def _validate_window(self) -> None:
        if self.kind == "softmax":  # sliding-window softmax: its other fields are checked as softmax's
            return
        if self.is_exact_exp:
            raise ValueError(
                f"AttentionSpec.window={self.window} is not allowed with {self.describe()}: a window splits a "
                "finite-state kernel into exact exp over the last W positions and the kernel beyond them. Use "
                "kind='softmax' for sliding-window softmax (nothing beyond the window), kind='linear' (a feature "
                "map) or kind='recurrent_softmax' with a taylor_order"
            )
        if self.normalizer not in ROW_SCALE_INVARIANT_NORMALIZERS:
            raise ValueError(
                f"AttentionSpec.normalizer={self.normalizer!r} is not allowed with window={self.window}; "
                "expected one of "
                f"{list(ROW_SCALE_INVARIANT_NORMALIZERS)} (the exact part is computed shifted by its row maximum)"
            )
        if self.score_clamp is not None:
            raise ValueError(
                f"AttentionSpec.score_clamp={self.score_clamp!r} is not allowed with window={self.window}; "
                "expected None"
            )

    def _validate_delta_rule(self) -> None:
        """The delta rule corrects a finite state, and its denominator column is a correction too: it
        stays positive only beside an exact part, so without a window the normaliser must not read it."""
        if not self.has_finite_state:
            raise ValueError(
                f"AttentionSpec.delta_rule=True is not allowed with {self.describe()}: the delta rule corrects the "
                "finite recurrent state, which this spec does not have; expected delta_rule=False, or a finite-state "
                "spec (kind='linear', or kind='recurrent_softmax' with a taylor_order, and no score_clamp)"
            )
        if self.window is None and self.normalizer in DENOMINATOR_NORMALIZERS and not self.additive_mass:
            allowed = [name for name in NORMALIZERS if name not in DENOMINATOR_NORMALIZERS]
            raise ValueError(
                f"AttentionSpec.normalizer={self.normalizer!r} is not allowed with delta_rule=True and no window: "
                "a delta-rule state overwrites its denominator as it does its values, which can then be 0 or "
                f"negative; expected one of {allowed}, additive_mass=True (the normaliser then reads the additive "
                "denominator), or set a window (whose exact part keeps the denominator positive)"
            )

    def _validate_short_conv(self) -> None:
        """A width >= 2 on a finite-state spec: decoding keeps the convolution's last inputs in the recurrent
        state, which an exact-exp layer's key/value cache has no place for."""
        if self.short_conv < 2:
            raise ValueError(
                f"AttentionSpec.short_conv={self.short_conv!r} is not allowed; expected None or an int >= 2 (a width "
                "of 1 would only scale each channel)"
            )
        if not self.has_finite_state:
            raise ValueError(
                f"AttentionSpec.short_conv={self.short_conv} is not allowed with {self.describe()}: decoding keeps "
                "the convolution's last inputs beside a finite recurrent state, which this spec does not have; "
                "expected short_conv=None, or a finite-state spec (kind='linear', or kind='recurrent_softmax' with a "
                "taylor_order, and no score_clamp)"
            )

    def _validate_beside_window(self, name: str, what: str) -> None:
        """`sinks` and `kept`: a count >= 1 of positions scored exactly beside a window of a finite-state spec."""
        value = getattr(self, name)
        if value < 1:
            raise ValueError(f"AttentionSpec.{name}={value!r} is not allowed; expected None or an int >= 1")
        if self.window is None or not self.has_finite_state:
            raise ValueError(
                f"AttentionSpec.{name}={value} is not allowed with {self.describe()}: {what} scored exactly beside "
                f"a sliding window of a finite-state spec; expected {name}=None, or set window (kind='linear', or "
                "kind='recurrent_softmax' with a taylor_order)"
            )

    # ------------------------------------------------------------------ derived facts
    @property
    def uses_taylor(self) -> bool:
        """The kernel is the order-N truncation of exp (recurrent_softmax or linear taylor)."""
        return self.taylor_order is not None

    @property
    def is_exact_exp(self) -> bool:
        """The kernel is the exact exponential: no finite recurrent state exists."""
        return self.kind in ("softmax", "recurrent_softmax") and self.taylor_order is None

    @property
    def has_finite_state(self) -> bool:
        """Chunked and recurrent modes exist: a finite feature map and no score clamp."""
        return not self.is_exact_exp and self.score_clamp is None

    @property
    def softcap_applies(self) -> bool:
        """A cap of the scaled scores (`ops.attention`'s `softcap`, Gemma 2's `attn_logit_softcapping`) has
        exact softmax scores to bend: kind "softmax" (over its window, if any), or a hybrid's window, sinks
        and kept positions (its finite state stays uncapped: the cap does not factor into a feature map)."""
        return self.kind == "softmax" or self.window is not None

    @property
    def effective_feature_map(self) -> str | None:
        """Feature map of the finite-state form ("taylor" for a truncated recurrent softmax)."""
        if self.kind == "recurrent_softmax" and self.taylor_order is not None:
            return "taylor"
        return self.feature_map

    @property
    def is_row_scale_invariant(self) -> bool:
        return self.normalizer in ROW_SCALE_INVARIANT_NORMALIZERS

    def scale(self, head_dim: int) -> float:
        """The multiplier of q.k (or phi(q).phi(k)) for this head size."""
        return head_dim**-0.5 if self.qk_scale is None else self.qk_scale

    def feature_dim(self, head_dim: int) -> int:
        """Width of phi(k), i.e. rows of the recurrent state S (finite-state specs only)."""
        _check_size("head_dim", head_dim)
        fmap = self.effective_feature_map
        if fmap == "taylor":
            return taylor_feature_dim(head_dim, self.taylor_order)
        if fmap == "hedgehog":
            return 2 * (self.hedgehog_dim or head_dim)
        return head_dim

    @property
    def exact_positions(self) -> int:
        """Keys a query scores exactly at most: the window (the query's own included), sinks and kept positions.
        With a finite state, a sequence of L positions sends keys through it only when L exceeds this."""
        return (self.window or 0) + (self.sinks or 0) + (self.kept or 0)

    def state_bytes(self, head_dim: int, value_dim: int | None = None, bytes_per_element: int = 4) -> int:
        """Bytes of the recurrent state of one KV head: S and z, plus the keys and values of the window, the
        sinks and the kept positions, and with kept positions one rank score per window and kept position
        and, per kept slot, its position (int64) and whether it is filled (bool). Each sequence adds its
        position counter (int64), and with a window one flag (bool) per window position and the ring's
        start (int64), shared by its KV heads. A short convolution adds its last K - 1 keys and values."""
        value_dim = head_dim if value_dim is None else value_dim
        for name, size in (("head_dim", head_dim), ("value_dim", value_dim), ("bytes_per_element", bytes_per_element)):
            _check_size(name, size)
        exact = self.exact_positions * (head_dim + value_dim + 1)
        scores = (self.window or 0) + self.kept + 1 if self.kept is not None else 0
        kept_bookkeeping = (self.kept or 0) * (_POSITION_BYTES + _FLAG_BYTES)
        conv_tail = (self.short_conv - 1) * (head_dim + value_dim) if self.short_conv is not None else 0
        elements = self.feature_dim(head_dim) * (value_dim + 1) + exact + scores + conv_tail
        return elements * bytes_per_element + kept_bookkeeping

    def check_mode(self, mode: str, head_dim: int, max_state_bytes: int = DEFAULT_MAX_STATE_BYTES) -> None:
        """Raise a clear error if `mode` cannot compute this spec for this head size."""
        if mode not in MODES:
            raise _choice_error("mode", mode, MODES)
        if mode == "parallel":
            return
        if self.is_exact_exp:
            raise ValueError(
                f"mode={mode!r} needs a finite state, but {self.describe()} uses the exact exponential, which has "
                "none; use mode='parallel' (and a KV cache for decoding) or set taylor_order"
            )
        if self.score_clamp is not None:
            raise ValueError(
                f"mode={mode!r} needs a finite state, but score_clamp={self.score_clamp} does not factorise into "
                "features; use mode='parallel' or score_clamp=None"
            )
        size = self.state_bytes(head_dim)
        if size > max_state_bytes:
            raise ValueError(
                f"mode={mode!r} needs a state of {size:,} bytes per KV head ({self.feature_dim(head_dim):,} "
                f"features) for {self.describe()} at head_dim={head_dim}, above max_state_bytes={max_state_bytes:,}; "
                "use mode='parallel'" + (" or a lower taylor_order" if self.taylor_order is not None else "")
            )

    def fits_recurrent_state(self, head_dim: int, max_state_bytes: int = DEFAULT_MAX_STATE_BYTES) -> bool:
        """Whether decoding can use the constant-size recurrent state (else a KV cache)."""
        return self.has_finite_state and self.state_bytes(head_dim) <= max_state_bytes

    def describe(self) -> str:
        """One line in words, e.g. for model cards and tables."""
        if self.kind == "softmax":
            return "exact softmax attention" + (
                "" if self.window is None else f" over the last {self.window} positions"
            )
        if self.kind == "recurrent_softmax":
            kernel = (
                "exp(q.k)" if self.taylor_order is None else f"order-{self.taylor_order} Taylor expansion of exp(q.k)"
            )
        else:
            kernel = f"linear attention with the {self.feature_map} feature map" + (
                f" (order {self.taylor_order})" if self.taylor_order is not None else ""
            )
        parts = [kernel, f"{self.normalizer} normaliser"]
        if self.score_clamp is not None:
            parts.append(f"scores clamped at {self.score_clamp:g}")
        if self.input_gate:
            parts.append("input gate")
        if self.output_gate:
            parts.append(f"output gate ({self.output_gate_position.replace('_', ' ')})")
        if self.window is not None:
            exact = f"exact exp over the last {self.window} positions"
            if self.sinks is not None:
                exact += f" and the first {self.sinks}"
            if self.kept is not None:
                exact += f" and the {self.kept} most attended older ones"
            parts.insert(1, exact)
        if self.decay:
            parts.insert(2 if self.window is not None else 1, "data-dependent decay of the state")
        if self.delta_rule:
            state = "delta-rule state" + (" weighed by an additive mass" if self.additive_mass else "")
            parts.insert(2 if self.window is not None else 1, state)
        if self.short_conv is not None:
            parts.insert(1, f"keys and values through a short convolution of width {self.short_conv}")
        return ", ".join(parts)

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AttentionSpec:
        if not isinstance(data, Mapping):
            raise TypeError(f"AttentionSpec.from_dict takes a dict of spec fields; got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"AttentionSpec got unknown fields {unknown}; allowed fields are {sorted(known)}")
        return cls(**data)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> AttentionSpec:
        """The paper's variant `name` (see `PRESETS`), optionally with fields overridden."""
        if not isinstance(name, str) or name not in PRESET_FIELDS:
            raise ValueError(f"Unknown attention preset {name!r}; expected one of {sorted(PRESET_FIELDS)}")
        return cls.from_dict({**PRESET_FIELDS[name][1], **overrides})  # (an unknown override is named)

    @classmethod
    def coerce(cls, value: AttentionSpec | dict | str) -> AttentionSpec:
        """Accept a spec, a dict of fields, or a preset name."""
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            return cls.from_dict(value)
        if isinstance(value, str):
            return cls.from_preset(value)
        raise TypeError(f"Expected an AttentionSpec, a dict or a preset name, got {type(value).__name__}")


_OPTIONAL_INT = (int, type(None))
_NUMBER = (int, float)
#: (field, allowed types, in words) for the type check of every field.
_FIELD_TYPES = (
    ("kind", (str,), "a string"),
    ("taylor_order", _OPTIONAL_INT, "None or an int"),
    ("feature_map", (str, type(None)), "None or a string"),
    ("normalizer", (str,), "a string"),
    ("score_clamp", (*_NUMBER, type(None)), "None or a number"),
    ("input_gate", (bool,), "true or false"),
    ("output_gate", (bool,), "true or false"),
    ("output_gate_position", (str,), "a string"),
    ("chunk_size", (int,), "an int"),
    ("qk_scale", (*_NUMBER, type(None)), "None or a number"),
    ("hedgehog_dim", _OPTIONAL_INT, "None or an int"),
    ("norm_eps", _NUMBER, "a number"),
    ("window", _OPTIONAL_INT, "None or an int"),
    ("sinks", _OPTIONAL_INT, "None or an int"),
    ("decay", (bool,), "true or false"),
    ("kept", _OPTIONAL_INT, "None or an int"),
    ("delta_rule", (bool,), "true or false"),
    ("additive_mass", (bool,), "true or false"),
    ("short_conv", _OPTIONAL_INT, "None or an int"),
)
