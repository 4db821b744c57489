"""A compositional reward for the shapes world (GenEval's idea, by rule instead of a detector model).

``detect`` turns an image into a ``Scene``: after a light Gaussian smoothing, every pixel takes the palette
colour whose background-to-colour segment lies nearest (greys compete, so unsaturated pixels take none),
if within ``max_color_distance`` and at least half way along it; 4-connected components of one colour that
are big enough are candidates; each is fitted by a circle, a square and a triangle of the same area and
centroid, rendered anti-aliased (and blurred, for blurry generators), and takes the shape of best soft IoU
against the component's soft mask. ``examples.shapes.data.evaluate`` then checks the prompt's constraints.

Scorers (registry names): ``shapes_compositional`` (all constraints, ``mode`` fraction or all-or-nothing)
and ``shapes_object`` / ``shapes_count`` / ``shapes_color`` / ``shapes_position`` (one constraint kind
each, for zero-weight components whose means the RewardService records as metrics).
"""

from __future__ import annotations

import hashlib
import io
import math
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Literal

import numpy as np
from PIL import Image

from examples.shapes.data import (
    BACKGROUND,
    CONSTRAINT_KINDS,
    PALETTE,
    SHAPES,
    CaptionError,
    Scene,
    ShapeObject,
    ShapesPrompt,
    evaluate,
    parse_caption,
)
from unirl_core.errors import RewardError, field_error
from unirl_core.reward.scorers.base import ScoreItem

ScoreMode = Literal["fraction", "all"]
_MIN_ALPHA = 0.2
"""Below this share of a colour a pixel counts as background in the soft mask (noise floor)."""


@dataclass(frozen=True, kw_only=True)
class ShapesDetectorConfig:
    """Tolerances of the rule-based detector (all relative to the image, so any resolution works)."""

    colors: tuple[str, ...] | None = None
    """Colours to detect; None detects the whole palette, so a wrong palette colour is a colour error, not a miss."""
    max_color_distance: float = 90.0
    """RGB distance (0-255 scale) from a pixel to the background-to-colour segment within which the pixel may
    take that colour; farther pixels are ignored (off-palette, other colours, strong noise)."""
    min_area: float = 0.008
    """Smallest component kept (pixels at least half covered), as a fraction of the image area (32 px: 9 pixels;
    the world's smallest object, a triangle of side 0.2, covers 0.02)."""
    min_side: float = 0.14
    """Smallest fitted object side, as a fraction of the image side (the world draws >= 0.2; smoothed noise
    makes 3-4 px blobs at 32 px)."""
    min_iou: float = 0.6
    """A component whose best shape-template IoU is lower is not an object (blobs, noise, strokes)."""
    work_size: int = 128
    """Images larger than this are box-downsampled by an integer factor first (speed, denoising)."""
    denoise_sigma: float = 0.6
    """Gaussian blur (pixels, after downsampling) applied first against pixel noise; the shape fits are compared
    blurred as well, so this costs no accuracy on clean images. 0 turns it off."""

    def __post_init__(self) -> None:
        if self.colors is not None:
            object.__setattr__(self, "colors", tuple(self.colors))
            if not self.colors or any(c not in PALETTE for c in self.colors):
                raise field_error(RewardError, "shapes.colors", self.colors, f"names from {sorted(PALETTE)}",
                                  "leave it None to detect every palette colour")
        if not 10.0 <= self.max_color_distance <= 200.0:
            raise field_error(RewardError, "shapes.max_color_distance", self.max_color_distance,
                              "a distance in [10, 200]", "use 90")
        if not 0.0 < self.min_area < 0.1:
            raise field_error(RewardError, "shapes.min_area", self.min_area, "a fraction in (0, 0.1)", "use 0.008")
        if not 0.0 <= self.min_side < 0.5:
            raise field_error(RewardError, "shapes.min_side", self.min_side, "a fraction in [0, 0.5)", "use 0.14")
        if not 0.0 < self.min_iou <= 1.0:
            raise field_error(RewardError, "shapes.min_iou", self.min_iou, "a value in (0, 1]", "use 0.6")
        if not (isinstance(self.work_size, int) and self.work_size >= 16):
            raise field_error(RewardError, "shapes.work_size", self.work_size, "an integer >= 16", "use 128")
        if not 0.0 <= self.denoise_sigma <= 2.0:
            raise field_error(RewardError, "shapes.denoise_sigma", self.denoise_sigma, "a blur in [0, 2] pixels",
                              "use 0.6, or 0 to turn denoising off")


def _downsample(img: np.ndarray, work_size: int) -> np.ndarray:
    f = math.ceil(max(img.shape[:2]) / work_size)
    if f <= 1:
        return img.astype(np.float32)
    h, w = img.shape[0] // f * f, img.shape[1] // f * f
    return img[:h, :w].astype(np.float32).reshape(h // f, f, w // f, f, 3).mean(axis=(1, 3))


def color_alpha(img: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Per pixel, how far along the background-to-``name`` segment it lies (``alpha`` in [0, 1]: the share of
    the pixel a shape of that colour covers) and its squared RGB distance from that segment."""
    bg = np.asarray(BACKGROUND, dtype=np.float32)
    v = np.asarray(PALETTE[name], dtype=np.float32) - bg
    rel = img - bg
    alpha = np.clip((rel @ v) / float(v @ v), 0.0, 1.0)
    return alpha, ((rel - alpha[..., None] * v) ** 2).sum(-1)


def color_labels(img: np.ndarray, names: Sequence[str], max_distance: float) -> tuple[np.ndarray, np.ndarray]:
    """``(labels, nearest)``, both ``[H, W]`` int. ``nearest`` is k+1 for the colour ``names[k]`` whose
    background-to-colour segment lies nearest to the pixel (within ``max_distance``; else 0); ``labels`` keeps
    it where the pixel is also at least half way along that segment (a shape covers at least half of it)."""
    # Greys compete too: a pixel nearer to the white-to-black axis than to any colour is no colour (smoothed
    # noise and dark strokes are grey), so only saturated pixels can start an object.
    grey = img.mean(-1, keepdims=True)
    best_d2 = np.minimum(((img - grey) ** 2).sum(-1), max_distance ** 2).astype(np.float32)
    nearest = np.zeros(img.shape[:2], dtype=np.int64)
    labels = np.zeros(img.shape[:2], dtype=np.int64)
    for k, name in enumerate(names, start=1):
        alpha, d2 = color_alpha(img, name)
        take = d2 < best_d2
        nearest[take] = k
        labels[take] = np.where(alpha[take] >= 0.5, k, 0)
        best_d2 = np.where(take, d2, best_d2)
    return labels, nearest


def components(mask: np.ndarray) -> np.ndarray:
    """``[H, W]`` int64 labels of the 4-connected components of ``mask`` (0 = off; a label is 1 + the flat
    index of the component's first pixel). Min-label propagation with pointer jumping, pure numpy."""
    h, w = mask.shape
    off = h * w + 1
    lab = np.where(mask, np.arange(1, h * w + 1, dtype=np.int64).reshape(h, w), off)
    while True:
        m = lab.copy()
        np.minimum(m[1:], lab[:-1], out=m[1:])
        np.minimum(m[:-1], lab[1:], out=m[:-1])
        np.minimum(m[:, 1:], lab[:, :-1], out=m[:, 1:])
        np.minimum(m[:, :-1], lab[:, 1:], out=m[:, :-1])
        m = np.where(mask, m, off)
        m = np.where(mask, np.minimum(m, m.ravel()[np.where(mask, m, 1) - 1]), off)  # jump to the label's label
        if np.array_equal(m, lab):
            return np.where(mask, lab, 0)
        lab = m


def _coverage(shape: str, cx: float, cy: float, side: float, h: int, w: int) -> np.ndarray:
    """``[h, w]`` share (0..1, 4x4 samples) of each pixel covered by ``shape`` centred at (cx, cy), pixel units."""
    dx = np.abs((np.arange(4 * w) + 0.5) / 4 - cx)[None, :]
    dy = ((np.arange(4 * h) + 0.5) / 4 - cy)[:, None]
    r = side / 2
    if shape == "circle":
        inside = dx ** 2 + dy ** 2 <= r * r
    elif shape == "square":
        inside = (dx <= r) & (np.abs(dy) <= r)
    else:
        inside = (dy <= r) & (2 * dx <= dy + r)
    return inside.reshape(h, 4, w, 4).mean(axis=(1, 3))


_SIDE_PER_ROOT_AREA = {"circle": math.sqrt(4 / math.pi), "square": 1.0, "triangle": math.sqrt(2.0)}


def classify(alpha: np.ndarray) -> tuple[str, float, tuple[float, float, float]]:
    """Fit each shape to a soft component mask (``alpha``: a window with room around the component) by its
    area and centroid, render the fit with anti-aliasing, and return the shape of best soft IoU
    (sum of minima / sum of maxima), that IoU and the fit's (cx, cy, side) in pixel units."""
    area = float(alpha.sum())
    ys, xs = np.arange(alpha.shape[0]) + 0.5, np.arange(alpha.shape[1]) + 0.5
    mx, my = float((alpha.sum(0) * xs).sum()) / area, float((alpha.sum(1) * ys).sum()) / area
    best = ("circle", -1.0, (mx, my, 0.0))
    for shape in SHAPES:
        side = _SIDE_PER_ROOT_AREA[shape] * math.sqrt(area)
        cy = my - side / 6 if shape == "triangle" else my  # a triangle's centroid sits a third above its base
        sharp = _coverage(shape, mx, cy, side, *alpha.shape)
        for sigma in _BLURS:  # a blurry generator's edges: compare against blurred fits too
            fit = _gaussian_blur(sharp, sigma)
            iou = float(np.minimum(fit, alpha).sum()) / float(np.maximum(fit, alpha).sum())
            if iou > best[1]:
                best = (shape, iou, (mx, cy, side))
    return best


_BLURS = (0.0, 0.5, 0.8, 1.1)
"""Gaussian blur sigmas (pixels) tried on every shape fit."""


def _gaussian_blur(img: np.ndarray, sigma: float, *, edge: bool = False) -> np.ndarray:
    """Separable Gaussian blur of a 2-D array; the border is extended (``edge``) or zero."""
    if sigma <= 0:
        return img
    r = max(1, math.ceil(2.5 * sigma))
    k = np.exp(-np.arange(-r, r + 1) ** 2 / (2 * sigma * sigma))
    k /= k.sum()
    p = np.pad(img, r, mode="edge" if edge else "constant")
    rows = sum(k[i] * p[i:i + img.shape[0]] for i in range(2 * r + 1))
    return sum(k[i] * rows[:, i:i + img.shape[1]] for i in range(2 * r + 1))


def _dilate(mask: np.ndarray) -> np.ndarray:
    """3x3 binary dilation."""
    p = np.pad(mask, 1)
    h, w = mask.shape
    return np.logical_or.reduce([p[dy:dy + h, dx:dx + w] for dy in range(3) for dx in range(3)])


def detect(image: np.ndarray, cfg: ShapesDetectorConfig | None = None) -> Scene:
    """The objects found in a ``[H, W, 3]`` uint8 image, in image-fraction coordinates (bounding-box centres)."""
    cfg = cfg or ShapesDetectorConfig()
    if image.ndim != 3 or image.shape[2] != 3 or min(image.shape[:2]) < 8:
        raise field_error(RewardError, "image.shape", image.shape, "[H, W, 3] with H, W >= 8", "pass an RGB image")
    img = _downsample(image, cfg.work_size)
    if cfg.denoise_sigma > 0:
        img = np.stack([_gaussian_blur(img[..., c], cfg.denoise_sigma, edge=True) for c in range(3)], axis=-1)
    names = cfg.colors or tuple(PALETTE)
    labels, nearest = color_labels(img, names, cfg.max_color_distance)
    h, w = labels.shape
    min_px = max(3, math.ceil(cfg.min_area * h * w))
    found = []
    for k, name in enumerate(names, start=1):
        comp = components(labels == k)
        ids, counts = np.unique(comp[comp > 0], return_counts=True)
        if not (counts >= min_px).any():
            continue
        alpha, _ = color_alpha(img, name)
        # Soft edge: unlabelled pixels nearest to this colour, not faint (noise), next to the component.
        soft = np.where((alpha >= _MIN_ALPHA) & (nearest == k) & (labels == 0), alpha, 0.0)
        for cid in ids[counts >= min_px]:
            ys, xs = np.nonzero(comp == cid)
            bh, bw = int(ys.max() - ys.min()) + 1, int(xs.max() - xs.min()) + 1
            if min(bh, bw) < 2 or max(bh, bw) > 2 * min(bh, bw):
                continue
            pad = max(bh, bw) // 2 + 2
            y0, y1 = max(int(ys.min()) - pad, 0), int(ys.max()) + pad + 1
            x0, x1 = max(int(xs.min()) - pad, 0), int(xs.max()) + pad + 1
            own = comp[y0:y1, x0:x1] == cid
            window = np.where(own, alpha[y0:y1, x0:x1], np.where(_dilate(own), soft[y0:y1, x0:x1], 0.0))
            shape, iou, (cx, cy, side) = classify(window)
            if iou >= cfg.min_iou and side >= cfg.min_side * max(h, w):
                found.append(ShapeObject(shape, name, (x0 + cx) / w, (y0 + cy) / h, side / max(h, w)))
    return Scene(tuple(found))


def _detector(kwargs: dict) -> ShapesDetectorConfig:
    known = {f.name for f in fields(ShapesDetectorConfig)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise field_error(RewardError, f"shapes scorer kwargs.{unknown[0]}", kwargs[unknown[0]],
                          f"one of {sorted(known)} (or mode / absent_value)", "fix the reward component's kwargs")
    return ShapesDetectorConfig(**kwargs)


def _image(item: ScoreItem) -> np.ndarray:
    if not item.media:
        raise RewardError("item has no media: the shapes scorers need Part.media (PNG bytes) filled by the rollout")
    try:
        with Image.open(io.BytesIO(item.media)) as im:
            return np.asarray(im.convert("RGB"))
    except Exception as e:  # PIL raises several unrelated types for bad bytes
        raise RewardError(f"media is not a decodable image ({len(item.media)} bytes): {e}") from e


def _prompt(item: ScoreItem) -> ShapesPrompt:
    """What the image should show: ``targets['caption']`` when the data set gave one (a prompt that leaves words
    out, ``data.shapes.omit``), else the prompt itself."""
    text = item.targets.get("caption", item.prompt)
    try:
        return parse_caption(text)
    except CaptionError as e:
        where = "targets['caption']" if "caption" in item.targets else "prompt"
        raise RewardError(f"{where} {text!r} is not a shapes-world caption ({e}); the shapes scorers only "
                          "score prompts from examples.shapes.data (data.source: shapes)") from e


_SCENES: OrderedDict[tuple[bytes, ShapesDetectorConfig], Scene] = OrderedDict()
"""Scenes of recently scored images, by (digest of the media bytes, detector config): the compositional scorer and
the zero-weight per-kind scorers of one reward config detect the same image once, not five times (detection is
deterministic, so a hit returns exactly what ``detect`` would)."""
_SCENES_MAX = 512
_SCENES_LOCK = threading.Lock()


def _scene(item: ScoreItem, cfg: ShapesDetectorConfig | None) -> Scene:
    cfg = cfg or ShapesDetectorConfig()
    key = (hashlib.blake2b(item.media or b"", digest_size=16).digest(), cfg)
    with _SCENES_LOCK:
        scene = _SCENES.get(key)
        if scene is not None:
            _SCENES.move_to_end(key)
            return scene
    scene = detect(_image(item), cfg)
    with _SCENES_LOCK:
        _SCENES[key] = scene
        while len(_SCENES) > _SCENES_MAX:
            _SCENES.popitem(last=False)
    return scene


def constraint_results(item: ScoreItem, cfg: ShapesDetectorConfig | None = None) -> list[tuple[str, bool]]:
    """(constraint kind, satisfied) for every constraint of the item's prompt, in prompt order."""
    prompt = _prompt(item)
    return [(c.kind, ok) for c, ok in evaluate(prompt, _scene(item, cfg)).items()]


class ShapesCompositional:
    """Registry ``shapes_compositional``: per item, the fraction of the prompt's constraints the detected
    objects satisfy (``mode='fraction'``) or 1/0 for all of them (``mode='all'``, GenEval's rule).

    A prompt that is not a shapes caption, or media that is not an image, raises RewardError (the service's
    failure policy records it); an image with nothing recognisable scores 0."""

    def __init__(self, mode: ScoreMode = "fraction", **detector) -> None:
        if mode not in ("fraction", "all"):
            raise field_error(RewardError, "shapes.mode", mode, "'fraction' or 'all'",
                              "'all' is GenEval's all-or-nothing")
        self.mode = mode
        self.detector = _detector(detector)

    def __call__(self, items: Sequence[ScoreItem]) -> list[float]:
        out = []
        for item in items:
            oks = [ok for _, ok in constraint_results(item, self.detector)]
            out.append(float(all(oks)) if self.mode == "all" else sum(oks) / len(oks))
        return out


class ShapesConstraintScore:
    """One constraint kind's satisfied fraction per item (``shapes_object``, ``shapes_count``, ``shapes_color``,
    ``shapes_position``). A prompt without that kind (no relation, for position) scores ``absent_value``."""

    kind: str = ""

    def __init__(self, absent_value: float = 1.0, **detector) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise field_error(RewardError, "kind", self.kind, f"one of {CONSTRAINT_KINDS}", "use a subclass")
        if not (isinstance(absent_value, (int, float)) and math.isfinite(absent_value)):
            raise field_error(RewardError, "shapes.absent_value", absent_value, "a finite number",
                              "use 1.0 (a constraint that is not asked is not violated)")
        self.absent_value = float(absent_value)
        self.detector = _detector(detector)

    def __call__(self, items: Sequence[ScoreItem]) -> list[float]:
        out = []
        for item in items:
            oks = [ok for kind, ok in constraint_results(item, self.detector) if kind == self.kind]
            out.append(sum(oks) / len(oks) if oks else self.absent_value)
        return out


class ShapesObjectScore(ShapesConstraintScore):
    kind = "object"


class ShapesCountScore(ShapesConstraintScore):
    kind = "count"


class ShapesColorScore(ShapesConstraintScore):
    kind = "color"


class ShapesPositionScore(ShapesConstraintScore):
    kind = "position"


def shapes_accuracy(items: Sequence[ScoreItem], cfg: ShapesDetectorConfig | None = None) -> dict[str, float]:
    """Evaluation summary: per constraint kind the accuracy over the constraints that exist (no absent
    values), plus ``all`` (GenEval: share of items with every constraint met) and ``fraction`` (mean score)."""
    hits: dict[str, list[bool]] = {k: [] for k in CONSTRAINT_KINDS}
    per_item = []
    for item in items:
        res = constraint_results(item, cfg)
        for kind, ok in res:
            hits[kind].append(ok)
        per_item.append([ok for _, ok in res])
    out = {k: sum(v) / len(v) for k, v in hits.items() if v}
    if per_item:
        out["all"] = sum(all(r) for r in per_item) / len(per_item)
        out["fraction"] = sum(sum(r) / len(r) for r in per_item) / len(per_item)
    return out
