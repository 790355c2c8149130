"""Name -> function registries, so a config string picks an estimator or loss (idea from verl).

Each registration states the part's contract next to its code: its `kind` (how the caller calls it,
one of the registry's kinds), its `inputs` (the tensors it needs beyond those every part of its
kind gets) and its `settings` (the `AlgorithmConfig` fields it takes as keyword arguments). Callers
dispatch on these, never on names. The names themselves are listed once, torch-free, in
`rl/config/algorithm_names.py` (the config schema's choices); a registry refuses any other name.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping, TypeVar

from rl.config.algorithm_names import ALGORITHM_CHOICES, CONFIG_CHECKED_INPUTS, CONFIG_INPUTS
from rl.config.schema import AlgorithmConfig

F = TypeVar("F", bound=Callable)

_CONFIG_FIELDS = frozenset(f.name for f in fields(AlgorithmConfig))
_NAMES_FILE = "rl/config/algorithm_names.py"


@dataclass(frozen=True)
class Entry:
    """One registered part and its contract."""

    name: str
    fn: Callable
    kind: str
    inputs: tuple[str, ...]
    settings: Mapping[str, str]  # keyword argument of fn -> AlgorithmConfig field it is read from


class Registry:
    """The parts one config field (`algorithm.<x>`) picks from.

    `kinds` are the ways a caller calls them; `inputs` the optional tensors a part may ask for."""

    def __init__(self, what: str, config_field: str, kinds: tuple[str, ...], inputs: tuple[str, ...] = ()) -> None:
        if config_field not in ALGORITHM_CHOICES:
            raise ValueError(f"{config_field} has no list of names in {_NAMES_FILE}: add one to ALGORITHM_CHOICES")
        self.what = what
        self.config_field = config_field
        self.kinds = kinds
        self.inputs = inputs
        self._entries: dict[str, Entry] = {}

    def register(self, name: str, *, kind: str, inputs: tuple[str, ...] = (),
                 settings: tuple[str, ...] | Mapping[str, str] = ()) -> Callable[[F], F]:
        """Decorator: register `fn` as `name`, called as its `kind` says, given `inputs` and `settings`
        (AlgorithmConfig field names, passed under the same keyword, or a {keyword: field} mapping)."""
        where = f"{self.what} {name!r}"
        if name not in ALGORITHM_CHOICES[self.config_field]:
            raise ValueError(f"{where} is not among the {self.config_field} choices: add it to {_NAMES_FILE}")
        if kind not in self.kinds:
            raise ValueError(f"{where}: kind {kind!r} is not one of {', '.join(self.kinds)}")
        inputs = tuple(inputs)
        unknown = [i for i in inputs if i not in self.inputs]
        if unknown:
            raise ValueError(f"{where}: unknown inputs {unknown}; a {self.what} may ask for {self.inputs or 'none'}")
        declared = CONFIG_INPUTS.get(self.config_field)
        if declared is not None:
            checked = {i for i in inputs if i in CONFIG_CHECKED_INPUTS}
            if checked != set(declared[name]):
                raise ValueError(f"{where} needs {sorted(checked)} of {list(CONFIG_CHECKED_INPUTS)}, but {_NAMES_FILE} "
                                 f"says {sorted(declared[name])}: make them agree (config validation reads the list)")
        by_keyword = dict(settings) if isinstance(settings, Mapping) else {s: s for s in settings}
        bad = sorted(set(by_keyword.values()) - _CONFIG_FIELDS)
        if bad:
            raise ValueError(f"{where}: settings {bad} are not AlgorithmConfig fields (rl/config/schema.py)")

        def add(fn: F) -> F:
            if name in self._entries:
                raise ValueError(f"{where} is registered twice")
            self._entries[name] = Entry(name, fn, kind, inputs, by_keyword)
            return fn

        return add

    def entry(self, name: str) -> Entry:
        if name not in self._entries:
            raise KeyError(
                f"{self.config_field}={name!r}: unknown {self.what}; choose one of {', '.join(self.names())}"
            )
        return self._entries[name]

    def get(self, name: str) -> Callable:
        return self.entry(name).fn

    def settings(self, name: str, config: Any) -> dict[str, Any]:
        """The keyword arguments `name` takes from the config (an AlgorithmConfig)."""
        return {keyword: getattr(config, field) for keyword, field in self.entry(name).settings.items()}

    def names(self) -> list[str]:
        return sorted(self._entries)
