"""Reading spec files (clusters, frameworks): TOML, optionally starting from a preset with ``base``."""

from __future__ import annotations

import sys
from collections.abc import Callable, Collection
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def read_spec(text: str, origin: str, *, presets: Collection[str], base_values: Callable[[str], dict[str, Any]],
              fields: Collection[str], error: type[Exception]) -> dict[str, Any]:
    """The values a spec file sets over its ``base`` preset's; ``error`` names the first unknown key or
    preset, or invalid TOML, with ``origin``."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise error(f"{origin}: invalid TOML: {exc}") from exc
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
