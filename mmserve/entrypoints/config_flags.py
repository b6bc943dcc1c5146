"""Command-line flags generated from configuration dataclasses. Each field documents itself with
`field(metadata={"help": ...})`; `flags_of` turns a dataclass's fields into `Flag`s (name, type, default, help,
group) and `add_flags` puts them on an argparse parser, grouped, each help ending with its default. Every flag
can also come from an environment variable (the prefix, then the flag's name in upper case with underscores:
`MMSERVE_MAX_NUM_SEQS`) or from a YAML file (`--config`; keys are flag names, with dashes or underscores);
`resolve` merges them: command line > environment > file > defaults. A bad value from the environment or the
file raises ConfigError naming the variable or the file's key and what is wrong with the value."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

HELP = "help"  # the metadata key of a field's documentation
UNSET: Any = type("Unset", (), {"__repr__": lambda self: "UNSET"})()  # not on the command line
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class ConfigError(ValueError):
    """A bad configuration value; the message starts with where it came from."""


@dataclass(frozen=True)
class Flag:
    """How one dataclass field is set from the command line, the environment and a config file."""

    owner: type  # the dataclass
    field: str
    group: str
    kind: type  # int | float | str | bool | list (of str)
    default: Any  # the field's default (for `negate`: the flag's, False)
    help: str
    option: str  # --name; a positional argument's bare name
    aliases: tuple[str, ...] = ()
    negate: bool = False  # a bool field that is True by default: the flag (--no-...) sets it False
    both: bool = False  # a bool field spelled --name / --no-name
    append: bool = False  # a list: repeat the flag, one entry each (else: several values after it)
    choices: tuple[str, ...] | None = None
    metavar: str | None = None

    @property
    def dest(self) -> str:
        return self.option.lstrip("-").replace("-", "_")

    @property
    def positional(self) -> bool:
        return not self.option.startswith("-")

    def env_var(self, prefix: str) -> str:
        return prefix + self.dest.upper()

    def field_value(self, value: Any) -> Any:
        """The flag's value as its field takes it."""
        if self.negate:
            return not value
        return tuple(value) if self.kind is list and isinstance(self.default, tuple) else value


def _kind(hint: Any) -> type:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) in (list, tuple):
        return list
    if hint in (int, float, str, bool):
        return hint
    raise TypeError(f"no flag type for {hint!r}")


def flags_of(
    owner: type, group: str, skip: Sequence[str] = (), **options: dict[str, Any]
) -> list[Flag]:
    """A Flag for each init field of the dataclass `owner` but `skip`, in `group`; `options[field]` overrides
    Flag's attributes (option, aliases, group, negate, both, append, choices, metavar, help: the last only for
    a class whose fields carry no help of their own)."""
    hints = typing.get_type_hints(owner)
    flags = []
    for f in dataclasses.fields(owner):
        if not f.init or f.name in skip:
            continue
        kw = dict(options.get(f.name, {}))
        help_ = kw.pop("help", None) or f.metadata.get(HELP)
        if not help_:
            raise TypeError(
                f"{owner.__name__}.{f.name} has no help: field(metadata={{'help': ...}})"
            )
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        kind = _kind(hints[f.name])
        if kind is bool and default and not (kw.get("negate") or kw.get("both")):
            raise TypeError(
                f"{owner.__name__}.{f.name}: a flag for a True default needs negate or both"
            )
        if kw.get("negate"):
            default = False
        kw.setdefault("option", "--" + f.name.replace("_", "-"))
        kw.setdefault("group", group)
        flags.append(Flag(owner, f.name, kind=kind, default=default, help=help_, **kw))
    return flags


def _shown(flag: Flag) -> str:
    value = flag.default
    if flag.kind is bool:
        return "on" if flag.negate or value else "off"
    if value is None or value in ([], ()):
        return "none"
    if isinstance(value, int) and "bytes" in flag.field and value % 2**20 == 0:
        return f"{value >> 20} MiB"
    return str(value)


class _Repeat(argparse.Action):
    """action=append whose entries replace a default rather than add to it."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        items = getattr(namespace, self.dest, None)
        items = [] if items is UNSET or items is None else list(items)
        setattr(namespace, self.dest, [*items, values])


def add_flags(
    parser: argparse.ArgumentParser, flags: Sequence[Flag], groups: Mapping[str, str]
) -> None:
    """Put `flags` on `parser` in argument groups (`groups`: name -> description, in help order)."""
    made = {name: parser.add_argument_group(name, text) for name, text in groups.items()}
    for flag in flags:
        tail = "; this flag turns it off" if flag.negate else ""
        kw: dict[str, Any] = {
            "help": f"{flag.help}{tail} (default: {_shown(flag)})".replace("%", "%%"),
            "default": UNSET,
        }
        if flag.positional:
            kw["nargs"] = "?"
        elif flag.kind is bool:
            kw["action"] = argparse.BooleanOptionalAction if flag.both else "store_true"
        elif flag.kind is list:
            kw.update(action=_Repeat) if flag.append else kw.update(nargs="*")
        else:
            kw["type"] = flag.kind
        if flag.choices:
            kw["choices"] = flag.choices
        if flag.metavar:
            kw["metavar"] = flag.metavar
        made[flag.group].add_argument(flag.option, *flag.aliases, **kw)


def _bool(text: str, where: str) -> bool:
    if text.strip().lower() in _TRUE:
        return True
    if text.strip().lower() in _FALSE:
        return False
    raise ConfigError(f"{where}: invalid boolean value {text!r} (true or false)")


def convert(flag: Flag, value: Any, where: str) -> Any:
    """A value from the environment (a string) or a YAML file (any YAML value) as the flag's type."""
    if value is None and (flag.default is None or flag.kind is list):
        return None if flag.default is None else []
    if flag.kind is bool:
        return value if isinstance(value, bool) else _bool(str(value), where)
    if flag.kind is list:
        if isinstance(value, list):
            return [str(v) for v in value]
        try:
            return shlex.split(str(value))
        except ValueError as exc:
            raise ConfigError(f"{where}: invalid list {value!r} ({exc})") from None
    if isinstance(value, (bool, list, dict)) or (flag.kind is int and isinstance(value, float)):
        raise ConfigError(f"{where}: invalid {flag.kind.__name__} value {value!r}")
    try:
        out = flag.kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: invalid {flag.kind.__name__} value {value!r}") from None
    if flag.choices and out not in flag.choices:
        options = ", ".join(map(repr, flag.choices))
        raise ConfigError(f"{where}: invalid choice {value!r} (choose from {options})")
    return out


def from_environment(
    flags: Sequence[Flag], environ: Mapping[str, str], prefix: str
) -> dict[str, tuple[Any, str]]:
    """dest -> (value, variable) for each flag whose variable is set and not empty."""
    out = {}
    for flag in flags:
        name = flag.env_var(prefix)
        if environ.get(name, "").strip():
            out[flag.dest] = (convert(flag, environ[name], name), name)
    return out


def from_file(flags: Sequence[Flag], path: str, where: str) -> dict[str, tuple[Any, str]]:
    """dest -> (value, "FILE: key") for each key of the YAML mapping in `path`."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigError(f"{where} {path}: cannot read it ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)  # parse errors carry one, others none
        line = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{where} {path}: not valid YAML{line}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where} {path}: expected a mapping of flag names to values")
    by_key = {}
    for flag in flags:
        for option in (flag.option, *flag.aliases):
            name = option.lstrip("-")
            by_key[name] = by_key[name.replace("-", "_")] = flag
    out: dict[str, tuple[Any, str]] = {}
    for key, value in data.items():
        flag = by_key.get(str(key))
        if flag is None:
            raise ConfigError(f"{path}: unknown key {key!r} (keys are flag names: max-num-seqs)")
        if flag.dest in out:
            raise ConfigError(f"{path}: {key} sets the same flag as {out[flag.dest][1]}")
        out[flag.dest] = (convert(flag, value, f"{path}: {key}"), f"{path}: {key}")
    return out


def resolve(
    parser: argparse.ArgumentParser,
    flags: Sequence[Flag],
    argv: Sequence[str],
    environ: Mapping[str, str],
    prefix: str,
) -> argparse.Namespace:
    """Parse `argv` and fill what it leaves out from the environment, then the YAML file of `--config` (or
    PREFIX_CONFIG), then the defaults. `args.sources` maps each dest not at its default to where it came from
    (the flag, the variable or "FILE: key"). Raises ConfigError for a bad environment or file value."""
    namespace = argparse.Namespace(**{f.dest: UNSET for f in flags}, config=None)
    args = parser.parse_args(list(argv), namespace=namespace)
    env = from_environment(flags, environ, prefix)
    path, where = args.config, "--config"
    if path is None and environ.get(prefix + "CONFIG", "").strip():
        path, where = environ[prefix + "CONFIG"], prefix + "CONFIG"
    file = from_file(flags, path, where) if path else {}
    args.sources = {}
    for flag in flags:
        value = getattr(args, flag.dest)
        if value is not UNSET:
            args.sources[flag.dest] = flag.option
        elif flag.dest in env or flag.dest in file:
            value, args.sources[flag.dest] = env[flag.dest] if flag.dest in env else file[flag.dest]
        else:
            value = list(flag.default) if flag.kind is list else flag.default
        setattr(args, flag.dest, value)
    return args


def name_source(message: str, flags: Sequence[Flag], sources: Mapping[str, str]) -> str:
    """A configuration ValueError's message ("max_num_seqs must be >= 1, got 0"), prefixed with where the
    value came from when the message starts with a field or flag name of a value that is not the default."""
    word = message.split(" ", 1)[0].rstrip(":")
    for flag in flags:
        if word in (flag.field, flag.dest) and flag.dest in sources:
            return f"{sources[flag.dest]}: {message}"
    return message
