"""The rank x step compute heatmap: a PNG (no pillow needed) and the HTML panel around it.
Each cell is a rank's compute time relative to its step's median, so a straggler is a red
row whatever the model's speed."""

from __future__ import annotations

import base64
import html
import struct
import zlib

import numpy as np

__all__ = ["HEATMAP_MAX_ROWS", "encode_png", "heatmap_panel", "heatmap_rgb"]

HEATMAP_MAX_ROWS = 512  # more ranks than this are binned (the slowest of a bin shows)


def encode_png(rgb: np.ndarray) -> bytes:
    """A minimal PNG encoder (8-bit RGB, no filtering): pillow is not needed."""
    h, w, _ = rgb.shape
    raw = np.concatenate(
        [np.zeros((h, 1), np.uint8), np.ascontiguousarray(rgb, np.uint8).reshape(h, w * 3)], axis=1
    )

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data))
            + kind
            + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
        )

    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(raw.tobytes(), 6))
        + chunk(b"IEND", b"")
    )


# Diverging map over log2(ratio to the step's median): blue 0.5x, white 1x, red 2x+.
_ANCHORS = np.array(
    [[49, 54, 149], [116, 173, 209], [247, 247, 247], [244, 109, 67], [165, 0, 38]], float
)
_MISSING = np.array([110, 110, 110], float)


def heatmap_rgb(matrix: np.ndarray, max_rows: int = HEATMAP_MAX_ROWS) -> np.ndarray:
    """Ranks x steps compute times as colours, each relative to its step's median."""
    m = np.where(np.isfinite(matrix), matrix, np.nan)
    med = np.full(m.shape[1], np.nan)
    cols = ~np.isnan(m).all(axis=0)  # all-NaN columns would make nanmedian warn
    if cols.any():
        med[cols] = np.nanmedian(m[:, cols], axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        t = np.clip(np.log2(m / np.where(med > 0, med, np.nan)), -1.0, 1.0)
    if t.shape[0] > max_rows:  # bin rows by their worst value, so a straggler stays visible
        k = -(-t.shape[0] // max_rows)
        pad = np.full((k * max_rows - t.shape[0], t.shape[1]), np.nan)
        binned = np.vstack([t, pad]).reshape(max_rows, k, t.shape[1])
        worst = np.where(np.isnan(binned), -np.inf, binned).max(axis=1)
        t = np.where(np.isneginf(worst), np.nan, worst)
    pos = (np.nan_to_num(t, nan=0.0) + 1.0) * 2.0  # 0..4 over the five anchors
    lo = np.clip(np.floor(pos).astype(int), 0, 3)
    frac = (pos - lo)[..., None]
    rgb = _ANCHORS[lo] * (1 - frac) + _ANCHORS[lo + 1] * frac
    rgb[np.isnan(t)] = _MISSING
    return rgb.round().astype(np.uint8)


def _scale(rgb: np.ndarray) -> tuple[np.ndarray, int, int]:
    rows, cols = rgb.shape[:2]
    cw = max(2, min(16, 640 // max(cols, 1)))
    ch = max(2, min(24, 320 // max(rows, 1)))
    return np.repeat(np.repeat(rgb, ch, axis=0), cw, axis=1), cw, ch


def _heatmap_html(
    png: bytes, ranks: list[int], steps: list[int], ch: int, k: int, slowest: str
) -> str:
    src = "data:image/png;base64," + base64.b64encode(png).decode()
    labels = ""
    if k == 1 and ch >= 10 and len(ranks) <= 64:
        labels = "".join(
            f'<div style="height:{ch}px;line-height:{ch}px">rank {r}</div>' for r in ranks
        )
        labels = f'<div style="text-align:right;padding-right:4px">{labels}</div>'
    rows = f"ranks {ranks[0]}-{ranks[-1]}" if ranks else "no ranks"
    if k > 1:
        rows += f", {k} ranks per row (the slowest of them)"
    gradient = ",".join(f"rgb({int(a[0])},{int(a[1])},{int(a[2])})" for a in _ANCHORS)
    return (
        '<div style="font-family:sans-serif;font-size:11px">'
        f'<div style="display:flex">{labels}<img src="{src}" '
        'style="image-rendering:pixelated"/></div>'
        f"<div>rows: {html.escape(rows)} (top to bottom); columns: steps "
        f"{steps[0] if steps else '-'}-{steps[-1] if steps else '-'} (left to right)</div>"
        "<div>colour: compute time relative to the step's median "
        f'<span style="display:inline-block;width:120px;height:9px;'
        f'background:linear-gradient(to right,{gradient})"></span> 0.5x - 1x - 2x; '
        f"grey: not reported</div><div>{html.escape(slowest)}</div></div>"
    )


def heatmap_panel(matrix: np.ndarray, ranks: list[int], steps: list[int]) -> tuple[bytes, str]:
    """The picture of a ranks x steps matrix of compute times (ms), and its HTML panel
    with axis labels, the colour scale and the slowest rank."""
    rgb = heatmap_rgb(matrix)
    k = -(-len(ranks) // rgb.shape[0])
    big, _, ch = _scale(rgb)
    png = encode_png(big)
    slowest = ""
    with np.errstate(all="ignore"):
        mean = np.nanmean(matrix, axis=1)
    if np.isfinite(mean).any():
        i = int(np.nanargmax(mean))
        others = np.delete(mean, i)
        med = float(np.nanmedian(others)) if np.isfinite(others).any() else 0.0
        ratio = f" ({mean[i] / med:.2f}x the median rank)" if med > 0 else ""
        slowest = f"slowest: rank {ranks[i]}, {mean[i]:.1f} ms compute per step{ratio}"
    return png, _heatmap_html(png, ranks, steps, ch, k, slowest)
