"""Reading spec files (clusters, frameworks): TOML, optionally starting from a preset with ``base``."""

from __future__ import annotations

import sys
from collections.abc import Callable, Collection
from importlib import resources
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def load_spec(spec: str, *, what: str, folder: str, presets: Collection[str], fields: Collection[str],
              base_values: Callable[[str], dict[str, Any]], error: type[Exception],
              defaults: dict[str, Any] | None = None,
              sections: dict[str, Collection[str]] | None = None) -> tuple[dict[str, Any], str]:
    """Every value of ``spec``, a preset name (a TOML file in ``autopar/<folder>``) or a path to a TOML file,
    and the origin errors name.  ``base_values(name)`` gives a preset's values for files that start from one;
    ``name`` defaults to the preset's or the file's stem, and the keys of ``defaults`` to its values.
    ``sections``: TOML tables that group keys (``[pipeline]``), each with the keys it may hold; their keys may
    also stand at the top level."""
    if spec in presets:
        text, name, origin = (resources.files("autopar").joinpath(folder, f"{spec}.toml").read_text(), spec,
                              f"{what} preset {spec}")
    else:
        path = Path(spec)
        if not path.is_file():
            raise error(f"unknown {what} {spec!r}: not a preset ({', '.join(presets)}) nor a TOML file")
        text, name, origin = path.read_text(), path.stem, str(path)
    values = read_spec(text, origin, presets=presets, base_values=lambda b: {**base_values(b), "name": name},
                       fields=fields, error=error, sections=sections)
    values.setdefault("name", name)
    for key, value in (defaults or {}).items():
        values.setdefault(key, value)
    missing = sorted(set(fields) - set(values))
    if missing:
        raise error(f"{origin}: missing key {missing[0]!r}")
    return values, origin


def read_spec(text: str, origin: str, *, presets: Collection[str], base_values: Callable[[str], dict[str, Any]],
              fields: Collection[str], error: type[Exception],
              sections: dict[str, Collection[str]] | None = None) -> dict[str, Any]:
    """The values a spec file sets over its ``base`` preset's; ``error`` names the first unknown key or
    preset, a key in the wrong section, or invalid TOML, with ``origin``."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise error(f"{origin}: invalid TOML: {exc}") from exc
    for section, keys in (sections or {}).items():
        table = data.pop(section, None)
        if table is None:
            continue
        if not isinstance(table, dict):
            raise error(f"{origin}: {section} must be a table ([{section}])")
        for key, value in table.items():
            if key not in keys:
                home = next((s for s, ks in sections.items() if key in ks), None)
                where = f"it belongs in [{home}]" if home else f"[{section}] holds {', '.join(sorted(keys))}"
                raise error(f"{origin}: [{section}] has no key {key!r} ({where})")
            if key in data:
                raise error(f"{origin}: {key!r} is set both at the top level and in [{section}]")
            data[key] = value
    base = data.pop("base", None)
    values: dict[str, Any] = {}
    if base is not None:
        if base not in presets:
            raise error(f"{origin}: unknown base preset {base!r} (presets: {', '.join(presets)})")
        values = base_values(base)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise error(f"{origin}: unknown key {unknown[0]!r} (known keys: {', '.join(sorted(fields))})")
    values.update(data)
    return values
