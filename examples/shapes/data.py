"""A synthetic caption -> image world: flat coloured circles, squares and triangles on white.

It gives a small text-to-image model something it can learn on a CPU and a reward that checks
composition by rule (``examples.shapes.reward``). A prompt is one to three object groups
(colour, shape, count 1-3, shapes distinct across groups) and, for two groups, an optional spatial
relation. ``caption`` writes it as English, ``parse_caption`` reads it back exactly.

Rendering is integer arithmetic on a fixed-point grid (4x4 samples per pixel), so the same scene gives
the same bytes on every machine.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from unirl_core.errors import ConfigError, UniRLError, field_error
from unirl_core.types import PromptRecord

PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (235, 200, 30),
    "purple": (140, 50, 180), "cyan": (40, 200, 210),
}
"""Every colour the world knows (RGB). Pairwise RGB distance >= 112, distance to the background >= 190."""
BACKGROUND: tuple[int, int, int] = (255, 255, 255)
DEFAULT_COLORS: tuple[str, ...] = ("red", "green", "blue", "yellow")
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")
ConstraintKind = Literal["object", "count", "color", "position"]
CONSTRAINT_KINDS: tuple[str, ...] = ("object", "count", "color", "position")

_NUMBER_WORDS = {1: "a", 2: "two", 3: "three"}
_NUMBER_READ = {"a": 1, "an": 1, "one": 1, "1": 1, "two": 2, "2": 2, "three": 3, "3": 3}
_RELATION_READ = {"left of": "left of", "to the left of": "left of", "right of": "right of",
                  "to the right of": "right of", "above": "above", "below": "below"}
_SUB = 4
"""Anti-aliasing samples per pixel side (16 per pixel)."""
_GAP = 0.06
"""Minimum free space between two objects' bounding boxes (image fraction): keeps blurred shapes apart."""
_MARGIN = 0.03
"""Minimum distance of an object from the image border (image fraction)."""


class CaptionError(UniRLError, ValueError):
    """A text is not a caption of the shapes world."""


@dataclass(frozen=True)
class ShapeObject:
    """One drawn object; ``cx, cy`` is the centre of its square bounding box, ``size`` its side (image fractions)."""

    shape: str
    color: str
    cx: float
    cy: float
    size: float


@dataclass(frozen=True)
class Scene:
    """The objects of one image (y grows downwards, as in image rows)."""

    objects: tuple[ShapeObject, ...] = ()


@dataclass(frozen=True)
class ObjectGroup:
    """``count`` objects of one colour and shape, e.g. "two red circles"."""

    color: str
    shape: str
    count: int = 1


@dataclass(frozen=True)
class Constraint:
    """One checkable claim of a prompt. ``group`` indexes ``ShapesPrompt.groups`` (0 for ``position``)."""

    kind: ConstraintKind
    group: int


@dataclass(frozen=True)
class ShapesPrompt:
    """One to three groups with distinct shapes; ``relation`` places ``groups[0]`` relative to ``groups[1]``."""

    groups: tuple[ObjectGroup, ...]
    relation: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", tuple(self.groups))
        if not 1 <= len(self.groups) <= 3:
            raise field_error(CaptionError, "groups", len(self.groups), "1 to 3 object groups", "shorten the prompt")
        for g in self.groups:
            if g.color not in PALETTE or g.shape not in SHAPES or g.count not in _NUMBER_WORDS:
                raise field_error(CaptionError, "group", g, f"colour in {sorted(PALETTE)}, shape in {SHAPES}, "
                                  "count 1-3", "use the world's colours, shapes and counts")
        shapes = [g.shape for g in self.groups]
        if len(set(shapes)) != len(shapes):
            raise field_error(CaptionError, "groups.shape", shapes, "a different shape in every group",
                              "a shape identifies its group (counts and colours are checked per shape)")
        if self.relation is not None and (self.relation not in RELATIONS or len(self.groups) != 2):
            raise field_error(CaptionError, "relation", self.relation, f"one of {RELATIONS} between exactly 2 groups",
                              "drop the relation or use two groups")

    @property
    def constraints(self) -> tuple[Constraint, ...]:
        """Per group: object (its shape is there), count (exactly), color (all of that shape); then position."""
        out = [Constraint(kind, i) for i in range(len(self.groups)) for kind in ("object", "count", "color")]
        if self.relation is not None:
            out.append(Constraint("position", 0))
        return tuple(out)


def _group_text(g: ObjectGroup) -> str:
    return f"{_NUMBER_WORDS[g.count]} {g.color} {g.shape}{'s' if g.count > 1 else ''}"


def caption(prompt: ShapesPrompt) -> str:
    """English caption: "a red circle", "two blue squares", "two red circles left of a blue square",
    "a red circle and a green triangle", "a red circle, two blue squares and a green triangle"."""
    parts = [_group_text(g) for g in prompt.groups]
    if prompt.relation is not None:
        return f"{parts[0]} {prompt.relation} {parts[1]}"
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


_REL_RE = re.compile(r"^(.+?) (to the left of|to the right of|left of|right of|above|below) (.+)$")


def _parse_group(words: str, text: str) -> ObjectGroup:
    toks = words.split(" ")
    if len(toks) != 3 or toks[0] not in _NUMBER_READ:
        raise field_error(CaptionError, "caption", text, f"groups like 'two red circles', got {words!r}",
                          "write <a|two|three> <colour> <shape(s)>")
    count, color, noun = _NUMBER_READ[toks[0]], toks[1], toks[2]
    shape = noun[:-1] if count > 1 and noun.endswith("s") else noun
    if color not in PALETTE:
        raise field_error(CaptionError, "caption", text, f"a colour in {sorted(PALETTE)}, got {color!r}",
                          "use a palette colour")
    if shape not in SHAPES or (count > 1) != (noun != shape):
        raise field_error(CaptionError, "caption", text, f"a shape in {SHAPES} (plural for counts > 1), got {noun!r}",
                          "write e.g. 'a red circle' or 'two red circles'")
    return ObjectGroup(color, shape, count)


def parse_caption(text: str) -> ShapesPrompt:
    """The ShapesPrompt of a caption; exact inverse of ``caption``. Case, spacing, a final full stop,
    'an'/'one'/digits and 'to the left of' are tolerated; anything else raises CaptionError naming the text."""
    if not isinstance(text, str):
        raise field_error(CaptionError, "caption", text, "a string", "pass the prompt text")
    norm = " ".join(text.lower().replace(",", " , ").split()).rstrip(".").strip()
    m = _REL_RE.match(norm)
    if m is not None and " and " not in norm and "," not in norm:
        groups, relation = (_parse_group(m.group(1), text), _parse_group(m.group(3), text)), m.group(2)
    else:
        chunks = [c.strip() for c in re.split(r" , | and ", norm)]
        if not norm or any(not c for c in chunks):
            raise field_error(CaptionError, "caption", text, "a caption like 'two red circles left of a blue "
                              "square'", "see the caption grammar in unirl_core/data/README.md")
        groups, relation = tuple(_parse_group(c, text) for c in chunks), None
    try:
        return ShapesPrompt(groups, None if relation is None else _RELATION_READ[relation])
    except CaptionError as e:
        raise CaptionError(f"caption={text!r}: {e}") from e


def check_colours(name: str, colours: tuple[str, ...]) -> None:
    """Refuse, naming the field ``name``, colours that are not distinct names of the palette (or none)."""
    bad = [c for c in colours if c not in PALETTE]
    if not colours or bad or len(set(colours)) != len(colours):
        raise field_error(ConfigError, name, list(colours), f"distinct names from {sorted(PALETTE)}",
                          "e.g. [red, green, blue, yellow]")


@dataclass(frozen=True, kw_only=True)
class ShapesWorldConfig:
    """What the world draws: image size, colours, shapes, prompt complexity, object sizes."""

    size: int = 32
    """Rendered image side in pixels."""
    colors: tuple[str, ...] = DEFAULT_COLORS
    """Colours prompts use (a subset of PALETTE: red, green, blue, yellow, purple, cyan)."""
    shapes: tuple[str, ...] = SHAPES
    """Shapes prompts use (circle, square, triangle)."""
    max_groups: int = 2
    """Object groups per prompt, 1 to 3 (at most one per shape)."""
    max_count: int = 3
    """Objects per group, 1 to 3."""
    relation_prob: float = 0.5
    """Probability that a two-group prompt carries a relation (left of / right of / above / below)."""
    min_size: float = 0.2
    """Smallest object side (image fraction); crowded scenes shrink below it when they must."""
    max_size: float = 0.32
    """Largest object side (image fraction)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "colors", tuple(self.colors))
        object.__setattr__(self, "shapes", tuple(self.shapes))
        if not (isinstance(self.size, int) and 16 <= self.size <= 1024):
            raise field_error(ConfigError, "shapes.size", self.size, "an integer in [16, 1024]", "use 32 or 64")
        check_colours("shapes.colors", self.colors)
        if not self.shapes or any(s not in SHAPES for s in self.shapes) or len(set(self.shapes)) != len(self.shapes):
            raise field_error(ConfigError, "shapes.shapes", self.shapes, f"distinct names from {SHAPES}",
                              "e.g. [circle, square, triangle]")
        if not (isinstance(self.max_groups, int) and 1 <= self.max_groups <= len(self.shapes)):
            raise field_error(ConfigError, "shapes.max_groups", self.max_groups,
                              f"an integer in [1, {len(self.shapes)}] (one group per shape)", "use 1 or 2")
        if not (isinstance(self.max_count, int) and 1 <= self.max_count <= 3):
            raise field_error(ConfigError, "shapes.max_count", self.max_count, "an integer in [1, 3]", "use 3")
        if not 0.0 <= self.relation_prob <= 1.0:
            raise field_error(ConfigError, "shapes.relation_prob", self.relation_prob, "a probability", "use 0.5")
        if not 0.08 <= self.min_size <= self.max_size <= 0.45:
            raise field_error(ConfigError, "shapes.min_size/max_size", (self.min_size, self.max_size),
                              "0.08 <= min_size <= max_size <= 0.45", "use 0.2 and 0.32")


@dataclass(frozen=True, kw_only=True)
class ShapesPromptsConfig:
    """A seeded RL prompt set drawn from the world (``data.source: shapes``)."""

    num_prompts: int = 256
    """Prompts in the set (texts may repeat; ids are unique)."""
    seed: int = 0
    """Seed of the draw; prompt i depends only on (seed, i)."""
    world: ShapesWorldConfig = field(default_factory=ShapesWorldConfig)
    """Colours, shapes and complexity of the prompts."""
    omit: tuple[Literal["colour"], ...] = ()
    """Words left out of the prompt text the policy sees (``colour``: "two red circles" is prompted as "two
    circles"). The full caption stays the reward's target (``targets['caption']``, which the shapes scorers read
    before the prompt): what the user did not say, the reward still wants (prompt enhancement: an enhancer can
    add it back; ``shapes-enhance-colour``)."""

    distinct: bool = False
    """Every caption at most once: the set is the first ``num_prompts`` distinct captions of the seeded draw
    (prompt i depends only on the seed and the draws before it), so a step that samples every prompt weighs each
    caption once instead of by how often the draw repeats it (a one-colour world with one group has only 9
    captions). Refused, naming ``shapes.num_prompts``, when the world has fewer distinct captions."""

    def __post_init__(self) -> None:
        if not (isinstance(self.num_prompts, int) and self.num_prompts >= 1):
            raise field_error(ConfigError, "shapes.num_prompts", self.num_prompts, "an integer >= 1", "use e.g. 256")
        object.__setattr__(self, "omit", tuple(self.omit))
        bad = [w for w in self.omit if w not in OMITTABLE]
        if bad or len(set(self.omit)) != len(self.omit):
            raise field_error(ConfigError, "shapes.omit", list(self.omit), f"distinct names from {list(OMITTABLE)}",
                              "list the words to leave out of the prompts, e.g. [colour], or leave it empty")


OMITTABLE = ("colour",)
"""What ``ShapesPromptsConfig.omit`` may leave out of a prompt."""


def omit_words(text: str, omit: tuple[str, ...]) -> str:
    """``text`` without the kinds of words in ``omit`` ("two red circles" without colour: "two circles")."""
    drop = set(PALETTE) if "colour" in omit else set()
    return " ".join(w for w in text.split() if w not in drop)


_SHAPE_WORDS = frozenset(SHAPES) | frozenset(f"{s}s" for s in SHAPES)
_SHAPE_RE = re.compile(r"\b(?:" + "|".join(sorted(_SHAPE_WORDS, key=len, reverse=True)) + r")\b")


def with_colour(text: str, colour: str) -> str:
    """``text`` with ``colour`` before every shape word ("two circles", blue: "two blue circles"): the inverse of
    ``omit_words(..., ("colour",))`` for a one-colour caption. Refuses a text that names no shape or already
    names a colour."""
    if colour not in PALETTE:
        raise field_error(ConfigError, "colour", colour, f"a name from {sorted(PALETTE)}", "e.g. blue")
    words = re.findall(r"[a-z]+", text)
    if not any(w in _SHAPE_WORDS for w in words) or any(w in PALETTE for w in words):
        raise field_error(CaptionError, "text", text, "a shapes prompt that names a shape and no colour",
                          "give a caption with its colour left out (data.shapes.omit: [colour]), e.g. 'two circles'")
    return _SHAPE_RE.sub(lambda m: f"{colour} {m.group(0)}", text)


def _uniform(rng: random.Random | np.random.Generator, lo: float, hi: float) -> float:
    return float(rng.uniform(lo, hi))


def _below(rng: random.Random | np.random.Generator, n: int) -> int:
    return rng.randrange(n) if isinstance(rng, random.Random) else int(rng.integers(n))


def sample_prompt(rng: random.Random | np.random.Generator, *, max_groups: int = 2, max_count: int = 3,
                  colors: tuple[str, ...] = DEFAULT_COLORS, shapes: tuple[str, ...] = SHAPES,
                  relation_prob: float = 0.5) -> ShapesPrompt:
    """A random prompt: 1..max_groups groups of distinct shapes, counts 1..max_count, maybe a relation."""
    ShapesWorldConfig(max_groups=max_groups, max_count=max_count, colors=colors, shapes=shapes,
                      relation_prob=relation_prob)  # validates the arguments
    n_groups = 1 + _below(rng, max_groups)
    pool = list(shapes)
    groups = []
    for _ in range(n_groups):
        shape = pool.pop(_below(rng, len(pool)))
        groups.append(ObjectGroup(colors[_below(rng, len(colors))], shape, 1 + _below(rng, max_count)))
    relation = None
    if n_groups == 2 and _uniform(rng, 0.0, 1.0) < relation_prob:
        relation = RELATIONS[_below(rng, len(RELATIONS))]
    return ShapesPrompt(tuple(groups), relation)


def _regions(prompt: ShapesPrompt, rng) -> list[tuple[float, float, float, float]]:
    """Per group, the box (x0, y0, x1, y1) its objects must lie in; a relation splits the image in two."""
    full = (_MARGIN, _MARGIN, 1 - _MARGIN, 1 - _MARGIN)
    if prompt.relation is None:
        return [full] * len(prompt.groups)
    split = _uniform(rng, 0.4, 0.6)
    first = (_MARGIN, split - _GAP / 2)
    second = (split + _GAP / 2, 1 - _MARGIN)
    a, b = (first, second) if prompt.relation in ("left of", "above") else (second, first)
    if prompt.relation in ("left of", "right of"):
        return [(a[0], _MARGIN, a[1], 1 - _MARGIN), (b[0], _MARGIN, b[1], 1 - _MARGIN)]
    return [(_MARGIN, a[0], 1 - _MARGIN, a[1]), (_MARGIN, b[0], 1 - _MARGIN, b[1])]


def _apart(o: ShapeObject, placed: list[ShapeObject]) -> bool:
    return all(abs(o.cx - p.cx) >= (o.size + p.size) / 2 + _GAP or abs(o.cy - p.cy) >= (o.size + p.size) / 2 + _GAP
               for p in placed)


def _random_layout(prompt: ShapesPrompt, regions, rng, min_size: float, max_size: float) -> list[ShapeObject]:
    """Each object at a uniform position in its group's region; [] when one does not fit after 100 tries."""
    placed: list[ShapeObject] = []
    for g, (x0, y0, x1, y1) in zip(prompt.groups, regions):
        for _ in range(g.count):
            s = min(_uniform(rng, min_size, max_size), x1 - x0, y1 - y0)
            for _try in range(100):
                o = ShapeObject(g.shape, g.color, _uniform(rng, x0 + s / 2, x1 - s / 2),
                                _uniform(rng, y0 + s / 2, y1 - s / 2), s)
                if _apart(o, placed):
                    placed.append(o)
                    break
            else:
                return []
    return placed


def _grid_layout(prompt: ShapesPrompt, regions, rng, min_size: float, max_size: float) -> list[ShapeObject]:
    """Objects sharing a region go into distinct random cells of a grid over it (sizes capped by the cell)."""
    jobs: dict[tuple, list[ObjectGroup]] = {}
    for g, r in zip(prompt.groups, regions):
        jobs.setdefault(r, []).extend([g] * g.count)
    placed = []
    for (x0, y0, x1, y1), objs in jobs.items():
        n, width, height = len(objs), x1 - x0, y1 - y0
        cols = max(range(1, n + 1), key=lambda c: min(width / c, height / -(-n // c)))
        cw, ch = width / cols, height / -(-n // cols)
        cells = list(range(cols * -(-n // cols)))
        for g in objs:
            cell = cells.pop(_below(rng, len(cells)))
            s = min(_uniform(rng, min_size, max_size), min(cw, ch) - _GAP)
            left, top = x0 + (cell % cols) * cw + _GAP / 2, y0 + (cell // cols) * ch + _GAP / 2
            placed.append(ShapeObject(g.shape, g.color, left + s / 2 + _uniform(rng, 0, cw - _GAP - s),
                                      top + s / 2 + _uniform(rng, 0, ch - _GAP - s), s))
    return placed


def sample_scene(prompt: ShapesPrompt, rng: random.Random | np.random.Generator, *, min_size: float = 0.2,
                 max_size: float = 0.32) -> Scene:
    """Objects that satisfy every constraint of ``prompt``, none overlapping (bounding boxes >= 6% apart).

    Positions are uniform (rejection sampling, 10 attempts); crowded scenes that do not fit fall back to
    distinct cells of a grid, where a cell smaller than ``min_size`` caps the object size."""
    regions = _regions(prompt, rng)
    for _attempt in range(10):
        placed = _random_layout(prompt, regions, rng, min_size, max_size)
        if placed:
            return Scene(tuple(placed))
    return Scene(tuple(_grid_layout(prompt, regions, rng, min_size, max_size)))


def _inside(shape: str, X: np.ndarray, Y: np.ndarray, cx: int, cy: int, h: int) -> np.ndarray:
    """Integer inside test on the sample grid (X is a row vector, Y a column vector)."""
    dx, dy = X - cx, Y - cy
    if shape == "circle":
        return dx * dx + dy * dy <= h * h
    if shape == "square":
        return (np.abs(dx) <= h) & (np.abs(dy) <= h)
    return (dy <= h) & (2 * np.abs(dx) <= dy + h)  # apex (cx, cy - h), base corners (cx -+ h, cy + h)


def coverage(shape: str, cx: float, cy: float, size: float, px: int) -> np.ndarray:
    """``[px, px]`` int64 count (0..16) of a pixel's 4x4 samples inside the shape (image-fraction geometry)."""
    unit = 2 * _SUB * px  # grid unit: half a sample spacing, so sample centres are odd integers
    grid = 2 * np.arange(_SUB * px, dtype=np.int64) + 1
    inside = _inside(shape, grid[None, :], grid[:, None], round(cx * unit), round(cy * unit), round(size * unit / 2))
    return inside.reshape(px, _SUB, px, _SUB).sum(axis=(1, 3), dtype=np.int64)


def render(scene: Scene, size: int) -> np.ndarray:
    """``[size, size, 3]`` uint8 image of ``scene``: anti-aliased by 4x4 coverage, integer arithmetic only."""
    if not (isinstance(size, int) and 8 <= size <= 4096):
        raise field_error(ConfigError, "size", size, "an integer in [8, 4096]", "use 32 or 64")
    full = _SUB * _SUB
    covered = np.zeros((size, size), dtype=np.int64)
    colour_sum = np.zeros((size, size, 3), dtype=np.int64)
    for o in scene.objects:
        k = coverage(o.shape, o.cx, o.cy, o.size, size)
        covered += k
        colour_sum += k[..., None] * np.asarray(PALETTE[o.color], dtype=np.int64)
    if covered.max(initial=0) > full:
        raise field_error(UniRLError, "scene", scene, "objects that do not overlap", "place them apart")
    total = colour_sum + (full - covered)[..., None] * np.asarray(BACKGROUND, dtype=np.int64)
    return ((total + full // 2) // full).astype(np.uint8)


def _item_rng(seed: int, i: int) -> random.Random:
    return random.Random(f"shapes/{seed}/{i}")


def _prompt_of(rng: random.Random, cfg: ShapesWorldConfig) -> ShapesPrompt:
    return sample_prompt(rng, max_groups=cfg.max_groups, max_count=cfg.max_count, colors=cfg.colors,
                         shapes=cfg.shapes, relation_prob=cfg.relation_prob)


def make_dataset(n: int, *, seed: int, size: int | None = None,
                 config: ShapesWorldConfig | None = None) -> list[tuple[str, np.ndarray]]:
    """``n`` (caption, ``[size, size, 3]`` uint8 image) pairs; item i depends only on (seed, i, config).

    ``size`` defaults to ``config.size`` (32)."""
    cfg = config or ShapesWorldConfig()
    px = cfg.size if size is None else size
    if not (isinstance(n, int) and n >= 0):
        raise field_error(ConfigError, "n", n, "an integer >= 0", "ask for e.g. 1000 pairs")
    out = []
    for i in range(n):
        rng = _item_rng(seed, i)
        prompt = _prompt_of(rng, cfg)
        scene = sample_scene(prompt, rng, min_size=cfg.min_size, max_size=cfg.max_size)
        out.append((caption(prompt), render(scene, px)))
    return out


def prompt_list(n: int, *, seed: int, config: ShapesWorldConfig | None = None) -> list[str]:
    """The captions of ``make_dataset(n, seed=seed, config=config)`` without rendering."""
    cfg = config or ShapesWorldConfig()
    return [_caption_at(seed, i, cfg) for i in range(n)]


def _caption_at(seed: int, i: int, world: ShapesWorldConfig) -> str:
    return caption(_prompt_of(_item_rng(seed, i), world))


_DISTINCT_DRAWS = 200
"""Draws per wanted caption before ``distinct`` concludes the world has too few."""


def _distinct_captions(cfg: ShapesPromptsConfig) -> list[str]:
    out: dict[str, None] = {}
    for i in range(_DISTINCT_DRAWS * cfg.num_prompts):
        out.setdefault(_caption_at(cfg.seed, i, cfg.world))
        if len(out) == cfg.num_prompts:
            return list(out)
    raise field_error(ConfigError, "shapes.num_prompts", cfg.num_prompts,
                      f"at most the world's distinct captions with shapes.distinct ({len(out)} found in "
                      f"{_DISTINCT_DRAWS * cfg.num_prompts} draws)", f"set num_prompts <= {len(out)}, widen "
                      "shapes.world, or set distinct: false")


def shapes_prompts(cfg: ShapesPromptsConfig | None = None) -> list[PromptRecord]:
    """RL prompt records ``shapes-00000``... (no targets: the shapes scorers parse the prompt text; with
    ``cfg.omit`` the prompt leaves words out and ``targets['caption']`` holds the full caption)."""
    cfg = cfg or ShapesPromptsConfig()
    texts = (_distinct_captions(cfg) if cfg.distinct
             else prompt_list(cfg.num_prompts, seed=cfg.seed, config=cfg.world))
    if not cfg.omit:
        return [PromptRecord(prompt_id=f"shapes-{i:05d}", prompt=t) for i, t in enumerate(texts)]
    return [PromptRecord(prompt_id=f"shapes-{i:05d}", prompt=omit_words(t, cfg.omit), targets={"caption": t})
            for i, t in enumerate(texts)]


def evaluate(prompt: ShapesPrompt, scene: Scene) -> dict[Constraint, bool]:
    """Which constraints of ``prompt`` the objects of ``scene`` satisfy (objects match groups by shape)."""
    by_shape = {g.shape: [o for o in scene.objects if o.shape == g.shape] for g in prompt.groups}
    out: dict[Constraint, bool] = {}
    for c in prompt.constraints:
        g = prompt.groups[c.group]
        objs = by_shape[g.shape]
        if c.kind == "object":
            out[c] = bool(objs)
        elif c.kind == "count":
            out[c] = len(objs) == g.count
        elif c.kind == "color":
            out[c] = bool(objs) and all(o.color == g.color for o in objs)
        else:
            out[c] = _related(by_shape[prompt.groups[0].shape], by_shape[prompt.groups[1].shape], prompt.relation)
    return out


def _related(a: list[ShapeObject], b: list[ShapeObject], relation: str) -> bool:
    """Every object of ``a`` is strictly on the ``relation`` side of every object of ``b`` (by centres)."""
    if not a or not b:
        return False
    if relation == "left of":
        return max(o.cx for o in a) < min(o.cx for o in b)
    if relation == "right of":
        return min(o.cx for o in a) > max(o.cx for o in b)
    if relation == "above":
        return max(o.cy for o in a) < min(o.cy for o in b)
    return min(o.cy for o in a) > max(o.cy for o in b)
