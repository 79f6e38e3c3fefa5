"""Whether a shard's images decode: the one check behind `build-shards index --verify` and `build-shards inspect
--decode`, so both call the same images bad.

An image is bad when PIL cannot decode all of it into RGB, which is what the training stream does with it
(vit_mpp/data/image_decoder.py; a bad sample there is replaced and counted, and too many stop the run). Checking
costs a full decode of every image: about as much CPU as one epoch's decoding, once.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass, field

from PIL import Image

EXAMPLES = 5  # keys kept per shard and kind of problem: enough to find them, small in a manifest


def decode_error(data: bytes) -> str | None:
    """Why PIL cannot decode `data` into an RGB image (one line), or None when it can."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PIL's DecompressionBombWarning: training decodes such images too
            with Image.open(io.BytesIO(data)) as img:
                img.load()
                if img.mode != "RGB":
                    img.convert("RGB")
    except Exception as e:  # anything PIL raises on bad bytes (OSError, SyntaxError, ValueError, ...) is the answer
        return " ".join(f"{type(e).__name__}: {e}".split())[:200]
    return None


@dataclass
class KeyTally:
    """How many samples of one shard have a problem, the first few keys, and the first reason."""

    count: int = 0
    keys: list[str] = field(default_factory=list)
    reason: str = ""

    def add(self, key: str, reason: str = "") -> None:
        self.count += 1
        if len(self.keys) < EXAMPLES:
            self.keys.append(key)
        if not self.reason:
            self.reason = reason

    def check(self, key: str, data: bytes) -> None:
        """Decode `data` (the image of sample `key`) and count it when it does not decode."""
        reason = decode_error(data)
        if reason is not None:
            self.add(key, reason)

    def describe(self) -> str:
        more = ", ..." if self.count > len(self.keys) else ""
        why = f" (first: {self.reason})" if self.reason else ""
        return f"{self.count} sample(s), e.g. {', '.join(self.keys)}{more}{why}"
