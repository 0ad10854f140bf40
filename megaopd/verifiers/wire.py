"""The data a sandboxed program may send back: plain Python values as one line of tagged JSON.

A candidate's process returns only data, never objects: whatever it returns is turned into ints, floats, strings,
bools, None, bytes, complex, lists, tuples, sets and dicts, and nothing else crosses the boundary. The verifier
(or the trusted check process) parses that line defensively: size and nesting are capped and anything malformed is
:class:`WireError`, never another exception. So a returned object with a rigged ``__eq__`` arrives as plain data,
and a program that prints garbage only fails its own test.

This module imports nothing from megaopd: its source is embedded in the harness and the check process as is.
"""

import json
import math

MAX_DEPTH = 64  # nesting of lists / tuples / dicts the parser accepts
MAX_INT_DIGITS = 4000  # below Python's int/str conversion limit, so huge ints are an error, not a crash


class WireError(ValueError):
    """The line is not a value this module writes (too big, too deep, malformed, or an unsupported type)."""


def encode(value, depth=0):
    """``value`` as JSON-able tagged data; WireError for a type that is not plain data."""
    if depth > MAX_DEPTH:
        raise WireError("value nested too deeply")
    kind = type(value)
    if value is None or kind is bool or kind is str:
        return value
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        text = int.__repr__(int(value))
        return {"i": text} if len(text) > 15 else int(text)  # big ints travel as text: exact, parsed with a cap
    if isinstance(value, float):
        value = float(value)
        return value if math.isfinite(value) else {"f": repr(value)}
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, (bytes, bytearray)):
        return {"b": bytes(value).hex()}
    if isinstance(value, complex):
        return {"c": [encode(value.real), encode(value.imag)]}
    if isinstance(value, tuple):
        return {"t": [encode(x, depth + 1) for x in value]}
    if isinstance(value, list):
        return [encode(x, depth + 1) for x in value]
    if isinstance(value, (set, frozenset)):
        return {"s": [encode(x, depth + 1) for x in value]}
    if isinstance(value, dict):
        return {"d": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    raise WireError(f"unsupported return type {kind.__name__}")


def dumps(value):
    return json.dumps(encode(value), separators=(",", ":"))


def _decode(data, depth):
    if depth > MAX_DEPTH:
        raise WireError("value nested too deeply")
    if data is None or isinstance(data, (bool, str, float)):
        return data
    if isinstance(data, int):
        return data
    if isinstance(data, list):
        return [_decode(x, depth + 1) for x in data]
    if not isinstance(data, dict) or len(data) != 1:
        raise WireError("malformed value")
    (tag, body), = data.items()
    if tag == "i" and isinstance(body, str) and len(body) <= MAX_INT_DIGITS and body.lstrip("-").isdigit():
        return int(body)
    if tag == "f" and body in ("inf", "-inf", "nan"):
        return float(body)
    if tag == "b" and isinstance(body, str):
        return bytes.fromhex(body)
    if tag == "c" and isinstance(body, list) and len(body) == 2:
        return complex(*(_decode(x, depth + 1) for x in body))
    if tag == "t" and isinstance(body, list):
        return tuple(_decode(x, depth + 1) for x in body)
    if tag == "s" and isinstance(body, list):
        return set(_decode(x, depth + 1) for x in body)
    if tag == "d" and isinstance(body, list) and all(isinstance(p, list) and len(p) == 2 for p in body):
        return {_decode(k, depth + 1): _decode(v, depth + 1) for k, v in body}
    raise WireError(f"malformed value tagged {tag!r}")


def loads(line, max_bytes=1 << 20):
    """The value on one line written by :func:`dumps`; WireError for anything else, whatever the input."""
    if len(line) > max_bytes:
        raise WireError(f"value longer than {max_bytes} bytes")
    try:
        return _decode(json.loads(line), 0)
    except WireError:
        raise
    except (ValueError, TypeError, RecursionError, OverflowError, MemoryError) as e:  # JSON, hashability, depth
        raise WireError(f"{type(e).__name__}: {str(e)[:200]}") from None
