"""Byte sizes as people write them ("24GB", "22.5 GiB") and as TrainStream prints them."""

from __future__ import annotations

import re

GB = 1e9
_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(value, what: str = "vram_budget") -> int:
    """Bytes from an int or a string such as "24GB", "22.5 GiB" or "512MB"; `what` names the
    argument in the errors."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be a number of bytes or a string like '24GB'")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ValueError(f"{what} must be positive, got {value}")
        return int(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {value!r} as a size: use bytes or a string like '24GB' or '22.5GiB'")
    size = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if size <= 0:
        raise ValueError(f"{what} must be positive, got {value!r}")
    return int(size)


def format_size(nbytes: int) -> str:
    return f"{nbytes / GB:.2f} GB" if nbytes >= 0.1 * GB else f"{nbytes / 1e6:.1f} MB"
