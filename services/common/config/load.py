"""Loading: YAML plus dotted overrides, unknown keys with suggestions, every error
at once; and the resolved config saved with a run."""

from __future__ import annotations

import difflib
import re
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ValidationError,
)
from pydantic import TypeAdapter as _TypeAdapter

from rlfleet.common.config.checks import run_checks
from rlfleet.common.config.schema import (
    _CONFIG_FILE,
    NO_VALUE,
    ROLES,
    Config,
    ConfigError,
    ConfigIssue,
)


def _unwrap(tp: Any) -> Any:
    """Strip Annotated and Optional; a union of several real types is a leaf (None)."""
    while get_origin(tp) is Annotated:
        tp = get_args(tp)[0]
    if get_origin(tp) in (Union, types.UnionType):
        real = [a for a in get_args(tp) if a is not type(None)]
        return _unwrap(real[0]) if len(real) == 1 else None
    return tp


def _child(tp: Any) -> tuple[Literal["model", "dict", "leaf"], Any]:
    tp = _unwrap(tp)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return "model", tp
    if get_origin(tp) is dict:
        return "dict", get_args(tp)[1]
    return "leaf", tp


def _unknown_key(path: Sequence[str], model: type[BaseModel], value: Any) -> ConfigIssue:
    key, parent = path[-1], ".".join(path[:-1])
    prefix = f"{parent}." if parent else ""
    known = list(model.model_fields)
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
    if close:
        hint = "did you mean " + " or ".join(prefix + c for c in close) + "?"
    else:
        hint = f"known keys{' of ' + parent if parent else ''}: " + ", ".join(known)
    return ConfigIssue(".".join(path), f"unknown key; {hint}", value)


def _model_at(path: Sequence[str | int]) -> type[BaseModel] | None:
    """The model class a (pydantic error) location points into, if any."""
    kind, tp = "model", Config
    for part in path:
        if kind == "model" and isinstance(part, str) and part in tp.model_fields:
            kind, tp = _child(tp.model_fields[part].annotation)
        elif kind == "dict":
            kind, tp = _child(tp)
        else:
            return None
    return tp if kind == "model" else None


def _loc_path(loc: Sequence[str | int]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _issues_from(error: ValidationError, prefix: Sequence[str | int]) -> list[ConfigIssue]:
    issues = []
    for e in error.errors():
        loc = [*prefix, *e["loc"]]
        if e["type"] == "extra_forbidden":
            model = _model_at(loc[:-1])
            if model is not None:
                issues.append(_unknown_key([str(p) for p in loc], model, e["input"]))
                continue
        message = e["msg"].removeprefix("Value error, ")
        issues.append(ConfigIssue(_loc_path(loc), message, e["input"]))
    return issues


# --------------------------------------------------------------------------- loading


class OverrideValueError(ValueError):
    """An override's value that does not parse (the message is one line)."""


_FLOAT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+$")
# A key right after ``{`` or ``,`` with its colon not followed by a space: Hydra's
# ``{bonus:0.5}``, which YAML would read as the one key ``bonus:0.5``.
_TIGHT_KEY = re.compile(r"([{,]\s*)([A-Za-z_][\w.-]*):(?=[^\s/])")


def parse_override_value(text: str) -> Any:
    """An override's value as Hydra reads it: YAML, plus ``1e-6`` as a number (YAML 1.1
    wants ``1.0e-6``) and ``{a:1,b:2}`` as a mapping (YAML wants ``{a: 1, b: 2}``).

    Raises:
        OverrideValueError: not a value, said in one line.
    """
    if text.lstrip().startswith("{"):
        text = _TIGHT_KEY.sub(r"\1\2: ", text)
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at character {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise OverrideValueError(f"not a YAML value ({problem}{where})") from None
    if isinstance(value, str) and _FLOAT.match(value):
        return float(value)
    return value


def apply_overrides(
    raw: Mapping[str, Any], overrides: Sequence[str]
) -> tuple[dict[str, Any], list[ConfigIssue]]:
    """Apply ``a.b.c=value`` overrides (values parsed as YAML) to a copy of ``raw``.

    Keys are checked against the schema; a bad override is reported and skipped.
    A value replaces what was there (a mapping value replaces the whole section).
    """
    out: dict[str, Any] = _deep_copy(raw)
    issues: list[ConfigIssue] = []
    for text in overrides:
        key, sep, value_text = text.partition("=")
        key = key.strip()
        parts = key.split(".")
        if not sep or not all(parts):
            issues.append(ConfigIssue("overrides", "expected key.path=value", text))
            continue
        issue = _check_key(parts)
        if issue is not None:
            issues.append(ConfigIssue(issue.path, f"in overrides: {issue.message}", text))
            continue
        try:
            value = parse_override_value(value_text)
        except OverrideValueError as exc:
            issues.append(ConfigIssue(key, f"override value is {exc}", value_text))
            continue
        if parts[0] not in out and len(parts) > 1:
            out[parts[0]] = _seed(parts[0])
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                issues.append(
                    ConfigIssue(
                        ".".join(parts[: i + 1]), "is not a mapping, cannot set " + key, child
                    )
                )
                break
            node = child
        else:
            node[parts[-1]] = value
    return out, issues


def _seed(name: str) -> dict[str, Any]:
    """What an override into a section absent from the file starts from.

    Sections whose default is their model's defaults start empty; the others
    (``resource_pools``, ``mapping``) start from the Config-level default, so that
    ``mapping.actor=x`` changes one role rather than unmapping the rest.
    """
    field = Config.model_fields[name]
    if field.default_factory is _unwrap(field.annotation):
        return {}
    default = field.get_default(call_default_factory=True)
    dumped = default.model_dump() if isinstance(default, BaseModel) else default
    return _deep_copy(dumped) if isinstance(dumped, Mapping) else {}


def _check_key(parts: Sequence[str]) -> ConfigIssue | None:
    kind, tp = "model", Config
    for i, part in enumerate(parts):
        if kind == "model":
            if part not in tp.model_fields:
                return _unknown_key(parts[: i + 1], tp, NO_VALUE)
            kind, tp = _child(tp.model_fields[part].annotation)
        elif kind == "dict":
            kind, tp = _child(tp)
        else:
            return ConfigIssue(
                ".".join(parts), f"{'.'.join(parts[:i])} is a value, not a section", NO_VALUE
            )
    return None


def _deep_copy(raw: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in raw.items()}


def verl_default_pools(data: Any) -> Any:
    """``trainer.nnodes`` x ``trainer.n_gpus_per_node`` and no ``resource_pools``: one
    colocated ``global_pool: [n_gpus_per_node] * nnodes`` for every role (verl's layout)."""
    if not isinstance(data, Mapping) or "resource_pools" in data:
        return data
    trainer = data.get("trainer")
    if not isinstance(trainer, Mapping):
        return data
    nnodes, per_node = trainer.get("nnodes"), trainer.get("n_gpus_per_node")
    if nnodes is None and per_node is None:
        return data
    nnodes = 1 if nnodes is None else nnodes
    per_node = 1 if per_node is None else per_node
    if not isinstance(nnodes, int) or not isinstance(per_node, int) or nnodes < 1 or per_node < 1:
        return data  # the trainer section's validation reports the values
    out = dict(data)
    out["resource_pools"] = {"global_pool": [per_node] * nnodes}
    if "mapping" not in data:
        out["mapping"] = dict.fromkeys(ROLES, "global_pool")
    return out


def config_from_dict(
    raw: Mapping[str, Any] | None, overrides: Sequence[str] = (), *, source: str = "config"
) -> Config:
    """Validate a config mapping (plus overrides); raise :class:`ConfigError` with every issue.

    Each section is validated on its own, so an error in one does not hide the errors
    of the others; the cross-field checks that read only valid sections run too.
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError([ConfigIssue(source, "top level must be a mapping", raw)])
    verl_issues: list[ConfigIssue] = []
    from rlfleet.common.config import verl as verl_config  # imports this module: deferred

    mixed = verl_config.verl_overrides_on_rlfleet_layout(raw, overrides)
    if mixed:  # translating would read the whole rlfleet file as verl's
        raise ConfigError(mixed)
    translation = None
    if verl_config.is_verl_shaped(raw, overrides):  # verl's layout: see verl.py
        translation = verl_config.translate(raw, overrides)
        raw, overrides, verl_issues = translation.raw, translation.overrides, translation.issues
    data, issues = apply_overrides(raw, overrides)
    data = verl_default_pools(data)

    sections: dict[str, Any] = {}
    invalid: set[str] = set()
    for name, value in data.items():
        if name not in Config.model_fields:
            issues.append(_unknown_key([name], Config, value))
    for name, field in Config.model_fields.items():
        if name not in data:
            sections[name] = field.get_default(call_default_factory=True)
            continue
        section, section_issues, bad = _validate_section(name, data[name])
        sections[name] = section
        issues.extend(section_issues)
        invalid |= bad

    partial = Config.model_construct(**sections)
    issues.extend(run_checks(partial, invalid))
    if translation is not None:  # named as the input names them: verl's keys
        issues = [translation.named_as_given(i) for i in issues]
    issues = verl_issues + issues
    if issues:
        raise ConfigError(issues)
    return Config.model_validate(sections)


def _validate_section(name: str, value: Any) -> tuple[Any, list[ConfigIssue], set[str]]:
    """Validate one top-level section.

    Returns the section (on errors: re-validated without the failing keys, or the
    default), its issues, and the dotted paths that failed.
    """
    field = Config.model_fields[name]
    annotation: Any = field.annotation
    if value is None and _child(annotation)[0] != "leaf":
        value = {}  # an empty section in YAML (`critic:`) means all defaults
    adapter: _TypeAdapter[Any] = _TypeAdapter(annotation)
    try:
        return adapter.validate_python(value), [], set()
    except ValidationError as exc:
        issues = _issues_from(exc, [name])
        bad_keys = {e["loc"][0] if e["loc"] else None for e in exc.errors()}
    if isinstance(value, Mapping) and None not in bad_keys:
        trimmed = {k: v for k, v in value.items() if k not in bad_keys}
        try:
            return adapter.validate_python(trimmed), issues, {f"{name}.{k}" for k in bad_keys}
        except ValidationError:
            pass
    return field.get_default(call_default_factory=True), issues, {name}


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> Config:
    """Load one YAML file (None: all defaults) plus dotted overrides into a valid Config."""
    raw: Any = None
    source = "config"
    if path is not None:
        source = str(path)
        try:
            raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except yaml.YAMLError as exc:
            raise ConfigError([ConfigIssue(source, f"not valid YAML: {_yaml_why(exc)}")]) from exc
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ConfigError([ConfigIssue("--config", f"cannot read it: {why}", source)]) from exc
    return config_from_dict(raw, overrides, source=source)


def save_resolved(config: Config, run_dir: str | Path) -> Path:
    """Write the resolved config (every default filled) to ``run_dir/config.yaml``."""
    out = Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = out / _CONFIG_FILE
    body = yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False, allow_unicode=True)
    tmp = target.with_suffix(".yaml.tmp")
    tmp.write_text("# resolved rlfleet config; rlfleet.common.config.load_config reads it\n" + body)
    tmp.replace(target)
    return target


def _yaml_why(exc: yaml.YAMLError) -> str:
    """A YAML error in one line: where (line, column) and what."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}{problem}"
