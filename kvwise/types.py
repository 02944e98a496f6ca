"""User-facing request types: sampling parameters, outputs, finish reasons. No torch here."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from kvwise.errors import InvalidRequest
from kvwise.utils import parse_duration

# Bounds on what one request may make the engine hold or scan each step (a 400 naming the
# field past them): names of cache namespaces and conversations, stop strings, stop ids.
MAX_KEY_CHARS = 256  # tenant, cache_salt, session_id (prompt_cache_key)
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024  # one stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGPROBS = 20  # top logprobs a token (OpenAI's bound)
MIN_REPETITION_PENALTY = 0.01  # below it a seen token's logit / penalty may overflow
MAX_LOGIT_BIAS = 1024  # entries of logit_bias (OpenAI's 300; a bound on a step's work)
MAX_CACHE_BREAKPOINTS = 4  # Anthropic's limit on cache_control blocks
MAX_BREAKPOINT_TTL_S = 24 * 3600.0  # the longest a breakpoint may keep its prefix


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # this request's row failed (sampling, grammar, detokenizing): it alone


STRUCTURED_KINDS = ("json", "regex", "grammar", "choice")
MAX_GRAMMAR_CHARS = 64 * 1024  # a schema, regex, grammar or the choices, as text


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match: ``json`` (a JSON schema as a dict or its text; ``{}`` or
    ``{"type": "object"}`` for any object), ``regex``, ``grammar`` (Lark, llguidance's
    dialect) or ``choice`` (one of a list of strings). Compiled by llguidance; a schema or
    grammar it refuses is a ValueError naming ``field``."""

    kind: str
    value: object
    field: str = "structured"  # the request field it came from, for errors

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidRequest(
                self.field, f"kind must be one of {STRUCTURED_KINDS}, got {self.kind!r}"
            )
        if self.kind == "choice":
            if (
                not isinstance(self.value, (list, tuple))
                or not self.value
                or not all(isinstance(c, str) and c for c in self.value)
            ):
                raise InvalidRequest(self.field, "choice: a non-empty list of non-empty strings")
            object.__setattr__(self, "value", tuple(self.value))
        elif self.kind == "json":
            if not isinstance(self.value, (dict, str)):
                raise InvalidRequest(self.field, "json: a JSON schema (an object or its text)")
        elif not isinstance(self.value, str) or not self.value:
            raise InvalidRequest(self.field, f"{self.kind}: a non-empty string")
        if len(self.text) > MAX_GRAMMAR_CHARS:
            raise InvalidRequest(
                self.field, f"at most {MAX_GRAMMAR_CHARS} characters, got {len(self.text)}"
            )

    @property
    def text(self) -> str:
        """The constraint as text (its size, and a schema's canonical form)."""
        if isinstance(self.value, str):
            return self.value
        if self.kind == "choice":
            return "\n".join(self.value)  # type: ignore[arg-type]
        import json

        return json.dumps(self.value, sort_keys=True)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each new token, and when to stop.

    temperature 0 means greedy. ``top_k`` 0 (or -1) and ``top_p`` 1 and ``min_p`` 0 turn those
    filters off. With a ``seed`` the draw for the i-th output token depends only on (seed, i),
    so a seeded request gives the same text alone, batched or after preemption.

    Before the draw (greedy too), in this order: ``logit_bias`` (token id → added to its
    logit, as OpenAI's), the repetition penalty (HF's: a logit of a token seen in the prompt or
    the output divided by it when positive, multiplied when negative; 1: off), then the
    presence and frequency penalties (OpenAI's: ``presence * [count > 0] + frequency *
    count`` subtracted, counts over the output). ``logprobs`` k: each output token's logprob
    and the k most likely tokens' (0: the chosen one's only); ``prompt_logprobs`` k: the same
    for every prompt token after the first (such a request computes its whole prompt: a
    prefix cache hit would skip the rows). Logprobs are of the model's own distribution
    (log-softmax of its logits, before any bias, penalty or temperature).
    """

    max_tokens: int = 128
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias); a dict is accepted
    structured: StructuredOutput | None = None  # the output must match it (llguidance)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check_int("max_tokens", self.max_tokens)
        if self.max_tokens <= 0:
            raise InvalidRequest("max_tokens", f"must be at least 1, got {self.max_tokens}")
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidRequest("temperature", f"must be >= 0, got {self.temperature}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise InvalidRequest("top_k", f"must be -1, 0 (off) or positive, got {self.top_k}")
        _check_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise InvalidRequest("top_p", f"must be in (0, 1], got {self.top_p}")
        _check_number("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise InvalidRequest("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(
                "stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}"
            )
        for stop in self.stop:
            if not isinstance(stop, str) or not stop:
                raise InvalidRequest(
                    "stop", f"each stop string must be a non-empty string, got {stop!r}"
                )
            if len(stop) > MAX_STOP_CHARS:
                raise InvalidRequest(
                    "stop",
                    f"a stop string has at most {MAX_STOP_CHARS} characters, got {len(stop)}",
                )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(
                "stop_token_ids",
                f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}",
            )
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id)
            if token_id < 0:
                raise InvalidRequest("stop_token_ids", f"ids must be >= 0, got {token_id}")
        self._check_processing()

    def _check_processing(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value)
                if not 0 <= value <= MAX_LOGPROBS:
                    raise InvalidRequest(name, f"must be in [0, {MAX_LOGPROBS}], got {value}")
        for name in ("presence_penalty", "frequency_penalty"):
            _check_number(name, getattr(self, name))
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidRequest(name, f"must be in [-2, 2], got {getattr(self, name)}")
        _check_number("repetition_penalty", self.repetition_penalty)
        # NOTE: a logit divided by a penalty below this stays far from float32's range
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 10:
            raise InvalidRequest(
                "repetition_penalty",
                f"must be in [{MIN_REPETITION_PENALTY}, 10], got {self.repetition_penalty}",
            )
        bias = self.logit_bias
        pairs = tuple(bias.items()) if isinstance(bias, dict) else tuple(bias)
        if len(pairs) > MAX_LOGIT_BIAS:
            raise InvalidRequest(
                "logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(pairs)}"
            )
        for pair in pairs:
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise InvalidRequest("logit_bias", f"expected (token id, bias) pairs, got {pair!r}")
            _check_int("logit_bias", pair[0])
            _check_number("logit_bias", pair[1])
            if pair[0] < 0 or not -100 <= pair[1] <= 100:
                raise InvalidRequest(
                    "logit_bias", f"token ids >= 0 and biases in [-100, 100], got {pair!r}"
                )
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in pairs))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """A penalty is on: sampling reads the request's tokens."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )

    @property
    def processed(self) -> bool:
        """Something changes the logits before the draw (a bias or a penalty)."""
        return self.penalized or bool(self.logit_bias)


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(name, f"expected an integer, got {value!r}")


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequest(name, f"expected a finite number, got {value!r}")


@dataclass
class RequestMetrics:
    """Wall-clock times (``time.perf_counter`` seconds) of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        """Time to first token, from arrival."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def inter_token_times(self) -> list[float]:
        """Every gap between consecutive output tokens."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


@dataclass
class RequestOutput:
    """The result (or, streamed, the progress) of one request."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens not computed: device prefix hit + loaded from tiers
    num_kv_rows_projected: int
    metrics: RequestMetrics
    delta_text: str = ""
    num_loaded_tokens: int = 0  # of the cached tokens, those loaded from the slower tiers
    delta_token_ids: list[int] = field(default_factory=list)
    # SamplingParams.logprobs: each output token's k most likely (token id, logprob), best first
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # SamplingParams.prompt_logprobs: each prompt token's (logprob, top k); None for the first
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None
    # with logprobs of either kind: the text of every token id they name (special tokens too)
    token_texts: dict[int, str] | None = None
    # FinishReason.ERROR: why this request's row failed (the step's other rows went on)
    error: str | None = None
    # FinishReason.STOP by a stop string: that string (None: EOS or a stop token id)
    stop_string: str | None = None
    # prompt tokens this request computed that now sit under a cache breakpoint, by the
    # breakpoint's TTL as asked (seconds: 300.0 for Anthropic's 5m, 3600.0 for 1h); with
    # num_cached_tokens (read) and the rest (uncached input) they add up to the prompt
    cache_created_tokens: dict[float, int] = field(default_factory=dict)


@dataclass(frozen=True)
class CacheBreakpoint:
    """Keep the first ``num_tokens`` prompt tokens cached for ``ttl_s`` seconds, refreshed on
    each hit (Anthropic's ``cache_control``; ``core/breakpoints.py`` says how)."""

    num_tokens: int
    ttl_s: float

    def __post_init__(self) -> None:
        _check_int("cache_breakpoints", self.num_tokens)
        _check_number("cache_breakpoints", self.ttl_s)
        object.__setattr__(self, "ttl_s", float(self.ttl_s))
        if self.num_tokens <= 0:
            raise InvalidRequest(
                "cache_breakpoints", f"num_tokens must be positive, got {self.num_tokens}"
            )
        if not 0 < self.ttl_s <= MAX_BREAKPOINT_TTL_S:
            raise InvalidRequest(
                "cache_breakpoints",
                f"ttl_s must be in (0, {MAX_BREAKPOINT_TTL_S:.0f}] seconds, got {self.ttl_s}",
            )


def _check_breakpoints(value: object) -> tuple[CacheBreakpoint, ...]:
    """``cache_breakpoints`` as CacheBreakpoints ((num_tokens, ttl_s) pairs accepted) in
    prompt order; at most ``MAX_CACHE_BREAKPOINTS``. Any order of TTLs is taken (each block
    is kept for the longest covering it); Anthropic's "1h before 5m" is its route's rule."""
    if not isinstance(value, (tuple, list)):
        raise InvalidRequest("cache_breakpoints", f"expected a list, got {value!r}")
    if len(value) > MAX_CACHE_BREAKPOINTS:
        raise InvalidRequest(
            "cache_breakpoints", f"at most {MAX_CACHE_BREAKPOINTS}, got {len(value)}"
        )
    points = []
    for bp in value:
        if isinstance(bp, (tuple, list)) and len(bp) == 2:
            bp = CacheBreakpoint(*bp)
        if not isinstance(bp, CacheBreakpoint):
            raise InvalidRequest("cache_breakpoints", f"expected CacheBreakpoints, got {bp!r}")
        points.append(bp)
    return tuple(sorted(points, key=lambda b: (b.num_tokens, -b.ttl_s)))


@dataclass(frozen=True)
class RequestOptions:
    """How one request uses the cache, passed unchanged through every layer (server, async
    engine, engine, scheduler).

    Args:
        tenant: the cache namespace; requests of different tenants never share KV.
        cache_salt: a further split within one tenant.
        retention: keep this request's cached prefix ("1h", seconds, or None / "default" for
            plain LRU): kept blocks are evicted after all others, and kept that long in the
            disk and Redis tiers.
        session_id: names the conversation, so that ``park(session_id)`` can move its KV
            down to the tiers between turns.
        cache_breakpoints: up to 4 ``CacheBreakpoint``s: keep the prompt's first
            ``num_tokens`` for ``ttl_s``, refreshed on each hit (Anthropic's
            ``cache_control``; the engine's ``cache_min_tokens`` and ``cache_ttl_scale``
            apply); reported as ``RequestOutput.cache_created_tokens``.
    """

    tenant: str = "default"
    cache_salt: str | None = None
    retention: str | float | None = None
    session_id: str | None = None
    cache_breakpoints: tuple[CacheBreakpoint, ...] = ()
    retention_s: float | None = field(init=False, default=None)  # parsed ``retention``

    def __post_init__(self) -> None:
        if not isinstance(self.tenant, str) or not self.tenant:
            raise InvalidRequest("tenant", "must be a non-empty string")
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise InvalidRequest("cache_salt", "must be a string")
        if self.session_id is not None and (
            not isinstance(self.session_id, str) or not self.session_id
        ):
            raise InvalidRequest("session_id", "must be a non-empty string")
        for name in ("tenant", "cache_salt", "session_id"):
            value = getattr(self, name)
            if value is not None and len(value) > MAX_KEY_CHARS:
                raise InvalidRequest(name, f"at most {MAX_KEY_CHARS} characters, got {len(value)}")
        if self.retention not in (None, "default"):
            object.__setattr__(self, "retention_s", parse_duration(self.retention, "retention"))
        object.__setattr__(self, "cache_breakpoints", _check_breakpoints(self.cache_breakpoints))
