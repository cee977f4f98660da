"""Sizes in bytes, read and written one way everywhere: decimal units (GB = 10**9), as
device memory is sold; `parse_bytes` also takes binary ones (GiB = 2**30)."""

import re

__all__ = ["fmt_bytes", "parse_bytes"]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(text: str | int) -> int:
    """`"32GB"` -> 32e9, `"40GiB"` -> 40 * 2**30, `"512B"` -> 512; ints are bytes already.

    A string needs its unit: `"40"` is refused, since whether 40 bytes or 40 GB was
    meant cannot be known, and 40 bytes would make every layout fail.

    Raises:
        ValueError: not a number followed by a unit (B, KB, MB, GB, TB, KiB..TiB).
    """
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"device memory {text!r} is not a size; write a number and a unit, e.g. 32GB, "
            "40GiB or 16000000000B."
        )
    if not unit:
        raise ValueError(
            f"device memory {text!r} has no unit; write {match.group(1)}GB, "
            f"{match.group(1)}GiB, or {match.group(1)}B if bytes are meant."
        )
    return int(float(match.group(1)) * _UNITS[unit])


def fmt_bytes(n: int | float) -> str:
    """Bytes in the unit devices are sold in: GB (10**9) with one decimal, MB or kB below.

    Example:
        >>> fmt_bytes(40e9), fmt_bytes(2_500_000), fmt_bytes(512)
        ('40.0 GB', '2.5 MB', '0.5 kB')
    """
    for unit, size in (("GB", 1e9), ("MB", 1e6)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n / 1e3:.1f} kB"
