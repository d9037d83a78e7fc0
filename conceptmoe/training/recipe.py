"""Recipe files: a run's settings as TOML (``--config FILE``, ``recipe.toml`` in every run; CONCEPTMOE.md §5).

A ``train`` recipe holds ``TrainConfig`` fields by name (the flags, ``_`` for ``-``), e.g.
``tokens = 1200000``, and a ``[set]`` table of ModelConfig overrides (what ``--set`` gives); a
``compare`` recipe holds ``CompareConfig`` fields the same way, with ``[variants.LABEL]`` tables
(what ``--variants FILE`` holds) or ``variants = "FILE.json"``. ``"none"`` stands for an unset
value (TOML has no null). An ``[about]`` table of strings is for people (and for the tests, which
hold a study recipe to the record it names); it is not a setting. Files are read with the standard
library's ``tomllib`` (``read``), checked key by key against the dataclass's annotations, and
written by ``render`` (strings, numbers, bools, lists, tables: no dependency).

``freeze`` makes concrete what a default would decide when the run starts (the token budget,
warmup and validation interval in steps, the corpus, the precision), so that a recipe written
today still means the same run after a default moves (issue 42).
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
from pathlib import Path
from typing import Any

from ..device import default_dtype, resolve_device
from ..errors import UserError
from ..model.config import ModelConfig, parse_overrides
from ..data.corpus import DEFAULT_CORPUS
from .config import DEFAULT_TOKENS, TrainConfig, default_eval_every, default_warmup, model_config

NONE = "none"  # an unset value in a recipe
# Not written to a run's recipe.toml: where it goes and how this launch behaves, not what it trains;
# the tokenizer is retrained identically from the data (a compare's shared one is a path here).
RUN_CONTROL = ("out", "resume", "force", "progress", "verify", "tokenizer", "init_model")
# TrainConfig fields that are not keys of a train recipe ([set] holds the overrides).
NOT_READ = ("overrides", "init_model", "tokenizer", "progress")
LAUNCH_FLAGS = {"resume": "bool", "force": "bool", "verify": "bool"}  # train flags that are not settings
ABOUT = "about"  # free-text table: what a recipe is, the record it reproduces


def freeze(tc: TrainConfig, dtype: str | None = None) -> TrainConfig:
    """``tc`` with the defaults decided at run time made concrete: ``tokens`` (when neither it nor
    ``max_steps`` is set), ``warmup_steps``, ``eval_every``, ``data`` (the default corpus by name)
    and ``dtype`` (``dtype`` if given, e.g. the precision a run used, else this machine's default)."""
    steps = tc.total_steps
    fill: dict[str, Any] = {}
    if tc.max_steps is None and tc.tokens is None:
        fill["tokens"] = DEFAULT_TOKENS
    if tc.warmup_steps is None:
        fill["warmup_steps"] = default_warmup(steps)
    if tc.eval_every is None:
        fill["eval_every"] = default_eval_every(steps)
    if tc.data is None:
        fill["data"] = DEFAULT_CORPUS
    if tc.dtype is None:
        fill["dtype"] = dtype or default_dtype(resolve_device(tc.device))
    return dataclasses.replace(tc, **fill) if fill else tc


def train_recipe(tc: TrainConfig) -> dict[str, Any]:
    """The recipe of a (frozen) TrainConfig: config.json's training settings without ``RUN_CONTROL``,
    every field by name, so that fields added later are recorded too."""
    d = tc.to_dict()
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    out: dict[str, Any] = {}
    for k, v in d.items():
        if k in RUN_CONTROL or k == "overrides":
            continue
        if tc.init and k in ("model", "preset", "ratio", "strategy"):  # the init run brings the model
            continue
        if v is None:  # written only where reading it back as unset would give something else
            if defaults.get(k) not in (None, dataclasses.MISSING) or (k == "strategy" and tc.model == "conceptmoe"):
                out[k] = NONE
            continue
        out[k] = v
    if tc.overrides:
        out["set"] = dict(tc.overrides)
    return out


def render_train(tc: TrainConfig, dtype: str | None = None) -> str:
    """``recipe.toml`` of a run: its settings frozen (``freeze``), as TOML."""
    tc = freeze(tc, dtype)
    head = [f"conceptmoe train recipe: {model_config(tc).name}, every default frozen",
            "rerun: conceptmoe train --config RUN/recipe.toml --out NEW (flags given there override this file)"]
    return render(train_recipe(tc), head)


def render_compare(settings: dict[str, Any], models: list[tuple[str, TrainConfig]]) -> str:
    """``recipe.toml`` of a comparison (``CompareConfig.to_dict()``): the settings without ``out``,
    ``overrides`` as [set]; the models it trains and their learning rates as comments."""
    d = {k: v for k, v in settings.items() if k not in ("out", "overrides", "force", "jobs") and v is not None}
    if settings.get("overrides"):
        d["set"] = settings["overrides"]
    if not d.get("variants"):
        d.pop("variants", None)
    head = ["conceptmoe compare recipe; rerun: conceptmoe compare --config FILE --out NEW", "models it trains:"]
    head += [f"  {label}: {model_config(tc).name}, peak lr {tc.lr:g}" for label, tc in models]
    if settings.get("lr") is None:
        head.append("lr not set: each model's default (above); each run's recipe.toml records its own")
    if settings.get("dtype") is None:
        head.append("dtype not set: each run's default (bf16 on CUDA and AMX / AVX512-BF16 CPUs, else fp32)")
    return render(d, head)


# ---- writing -------------------------------------------------------------------------------

_BARE = re.compile(r"[A-Za-z0-9_-]+")


def _key(k: str) -> str:
    return k if _BARE.fullmatch(k) else _string(k)


def _string(s: str) -> str:
    esc = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}
    return '"' + "".join(esc.get(c) or (f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c)
                         for c in s) + '"'


def _value(v: Any) -> str:
    if v is None:
        return _string(NONE)
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)  # shortest round-trip form: 0.001, 1e-05, 2.0, inf, nan
    if isinstance(v, str):
        return _string(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_key(str(k))} = {_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def render(d: dict[str, Any], comments: list[str] = ()) -> str:
    """TOML text of ``d``: plain keys first, then each nested dict as a ``[table]``."""
    lines = [f"# {c}" for c in comments]

    def table(prefix: list[str], t: dict[str, Any]) -> None:
        subs = {k: v for k, v in t.items() if isinstance(v, dict) and v}
        plain = [f"{_key(str(k))} = {_value(v)}" for k, v in t.items() if k not in subs]
        if prefix and (plain or not subs):
            lines.extend(["", "[" + ".".join(_key(p) for p in prefix) + "]"])
        lines.extend(plain)
        for k, v in subs.items():
            table(prefix + [str(k)], v)

    table([], d)
    return "\n".join(lines) + "\n"


# ---- reading -------------------------------------------------------------------------------

def read(path: str, schema: type, skip: tuple[str, ...] = (), extra: dict[str, str] | None = None) -> dict[str, Any]:
    """A recipe file's settings, checked against ``schema``'s fields (their annotations) less
    ``skip``, plus ``extra`` (name -> annotation); ``[set]`` -> ``overrides``. Every problem is one
    UserError line naming the file."""
    where = f"--config {path}"
    try:
        raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise UserError(f"{where}: cannot read ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise UserError(f"{where}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{where}: not valid TOML ({e})") from None
    types = {f.name: f.type for f in dataclasses.fields(schema) if f.name not in skip} | (extra or {})
    out: dict[str, Any] = {}
    for key, v in raw.items():
        if key == "set":
            if not isinstance(v, dict):
                raise UserError(f"{where}: set must be a table of ModelConfig fields, e.g. [set] ratio_loss_weight = 0.5")
            out["overrides"] = model_overrides(v, f"{where}: [set]")
        elif key == ABOUT:
            if not isinstance(v, dict) or not all(isinstance(x, str) for x in v.values()):
                raise UserError(f"{where}: [{ABOUT}] is a table of strings (notes for people)")
        elif key in types and key != "overrides":
            out[key] = _checked(v, types[key], f"{where}: {key}")
        else:
            hint = (f"write it as {key.replace('-', '_')}" if key.replace("-", "_") in types
                    else f"known keys: {', '.join(sorted(set(types) - {'overrides'} | {'set', ABOUT}))}")
            raise UserError(f"{where}: unknown key {key!r}; {hint}")
    return out


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _checked(v: Any, ann: str, where: str) -> Any:
    """``v`` if it has the type ``ann`` names ("int | None", "list[float]", ...); "none" for an
    optional field gives None. Numbers must be finite."""
    ann = str(ann)
    base = ann.replace(" | None", "").strip()
    if "None" in ann and v == NONE:
        return None
    if " | " in base:  # e.g. a compare's variants: a table, or the path of a --variants file
        alts = base.split(" | ")
        for alt in alts:
            try:
                return _checked(v, alt, where)
            except UserError:
                continue
        raise UserError(f"{where} must be one of: {', '.join(alts)} (got {v!r})")
    if base == "list[list[float]]":  # --ratios: "1.5:1,2:2", [1.5, 2] or [[1.5, 1], [2, 2]]
        if isinstance(v, str):
            return v
        if isinstance(v, list) and all(_is_number(x) or (isinstance(x, list) and len(x) == 2
                                                        and all(_is_number(y) for y in x)) for x in v):
            return [[float(x), 1.0] if _is_number(x) else [float(y) for y in x] for x in v]
        raise UserError(f"{where} must be ratios like [1.5, 2, 3] or [[1.5, 1], [2, 2]] (got {v!r})")
    if base.startswith("list["):
        if not isinstance(v, list):
            raise UserError(f"{where} must be a list of {base[5:-1]} (got {v!r})")
        return [_checked(x, base[5:-1], where) for x in v]
    if base.startswith("dict["):
        if not isinstance(v, dict):
            raise UserError(f"{where} must be a table (got {v!r})")
        return v
    ok = {"str": isinstance(v, str), "bool": isinstance(v, bool), "float": _is_number(v),
          "int": isinstance(v, int) and not isinstance(v, bool)}.get(base)
    if ok is None:
        raise UserError(f"{where}: cannot be set in a recipe")
    what = {"str": "a string", "bool": "true or false", "float": "a number", "int": "an integer"}[base]
    if not ok:
        unset = f' or "{NONE}"' if "None" in ann else ""
        raise UserError(f"{where} must be {what}{unset} (got {v!r})")
    if base == "float" and not math.isfinite(v):
        raise UserError(f"{where} must be a finite number (got {v!r})")
    return float(v) if base == "float" else v


def model_overrides(table: dict[str, Any], where: str) -> dict[str, Any]:
    """A [set] table as typed ModelConfig overrides: the value's TOML type must be the field's
    (``"none"`` for an optional one); conversions and checks are ``--set``'s (parse_overrides)."""
    probe = ModelConfig(kind="moe")
    names = {f.name for f in dataclasses.fields(ModelConfig)} - {"extra"}
    out = {}
    for k, v in table.items():
        if k not in names:
            raise UserError(f"{where}: unknown model field {k!r}")
        default = getattr(probe, k)
        if isinstance(v, (dict, list)) and k != "elastic_ratios":
            raise UserError(f"{where} {k} must be a single value (got {v!r})")
        if isinstance(v, str) and v != NONE and not isinstance(default, str) and default is not None:
            raise UserError(f"{where} {k} must be a {type(default).__name__} (got {v!r})")
        if isinstance(default, bool) != isinstance(v, bool) and v != NONE:
            raise UserError(f"{where} {k} must be {'true or false' if isinstance(default, bool) else 'a number'} "
                            f"(got {v!r})")
        if isinstance(default, str) and not isinstance(v, str):
            raise UserError(f"{where} {k} must be a string (got {v!r})")
        if isinstance(v, float) and isinstance(default, int) and not isinstance(default, bool):
            raise UserError(f"{where} {k} must be an integer (got {v!r})")
        if isinstance(v, float) and not math.isfinite(v):
            raise UserError(f"{where} {k} must be a finite number (got {v!r})")
        text = (",".join(repr(float(x)) if _is_number(x) else str(x) for x in v) if isinstance(v, list)
                else str(v).lower() if isinstance(v, bool) else repr(v) if isinstance(v, float) else str(v))
        try:
            out[k] = parse_overrides([f"{k}={text}"])[k]
        except ValueError as e:
            raise UserError(f"{where} {k}: {str(e).split(': ', 1)[-1]}") from None
    return out
