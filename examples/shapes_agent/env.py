"""A tool-using VLM environment: pictures of colored shapes, and tools that count or zoom.

``Scene(seed)`` draws 3-7 shapes (circle, square, triangle) in four colors. The agent is asked how many
shapes of one color there are; it may call

- ``count(color)`` -> text, the number of shapes of that color whose center lies in the current view;
- ``zoom(region)`` -> a new image: the top / bottom / left / right half of the current view, enlarged
  (later ``count`` calls count in that view).

Bad tool use raises ``ToolError`` (unknown tool, bad arguments); the agent turns it into reward 0.

Example::

    scene = Scene(seed=3)
    scene.question("red"), scene.answer("red")
    scene.call("zoom", {"region": "top"})     # -> PIL image
    scene.call("count", {"color": "red"})      # -> "2"
"""

from __future__ import annotations

import base64
import io
import random

from PIL import Image, ImageDraw

COLORS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 30)}
REGIONS = ("top", "bottom", "left", "right")
TOOLS = [
    {"type": "function", "function": {
        "name": "count", "description": "Count the shapes of one color in the current view.",
        "parameters": {"type": "object", "properties": {"color": {"type": "string", "enum": list(COLORS)}},
                       "required": ["color"]}}},
    {"type": "function", "function": {
        "name": "zoom", "description": "Zoom into one half of the current view; returns the new view as an image.",
        "parameters": {"type": "object", "properties": {"region": {"type": "string", "enum": list(REGIONS)}},
                       "required": ["region"]}}},
]


class ToolError(Exception):
    """The model called a tool that does not exist, or with arguments the tool cannot take."""


class Scene:
    def __init__(self, seed: int, size: int = 112):
        rng = random.Random(seed)
        self.size = size
        self.shapes = []  # (kind, color, cx, cy, r) in [0, 1) coordinates
        for _ in range(rng.randint(3, 7)):
            self.shapes.append((rng.choice(("circle", "square", "triangle")), rng.choice(list(COLORS)),
                                rng.uniform(0.1, 0.9), rng.uniform(0.1, 0.9), rng.uniform(0.05, 0.1)))
        self.view = (0.0, 0.0, 1.0, 1.0)  # x0, y0, x1, y1 of the full picture

    def question(self, color: str) -> str:
        return f"How many {color} shapes are in the picture? Answer with a number."

    def answer(self, color: str) -> int:
        return sum(1 for _, c, *_ in self.shapes if c == color)

    def image(self) -> Image.Image:
        """The current view, rendered at ``size`` x ``size``."""
        x0, y0, x1, y1 = self.view
        sx, sy = self.size / (x1 - x0), self.size / (y1 - y0)
        img = Image.new("RGB", (self.size, self.size), (255, 255, 255))
        draw = ImageDraw.Draw(img)
        for kind, color, cx, cy, r in self.shapes:
            px, py, rx, ry = (cx - x0) * sx, (cy - y0) * sy, r * sx, r * sy
            box = (px - rx, py - ry, px + rx, py + ry)
            if kind == "circle":
                draw.ellipse(box, fill=COLORS[color])
            elif kind == "square":
                draw.rectangle(box, fill=COLORS[color])
            else:
                draw.polygon([(px, py - ry), (px - rx, py + ry), (px + rx, py + ry)], fill=COLORS[color])
        return img

    def call(self, name: str, args: dict):
        """Run a tool: ``count`` returns text, ``zoom`` a new image. ToolError on bad use."""
        if not isinstance(args, dict):
            raise ToolError(f"{name}: arguments must be a JSON object, got {args!r}")
        if name == "count":
            color = args.get("color")
            if color not in COLORS:
                raise ToolError(f"count: color must be one of {list(COLORS)}, got {color!r}")
            x0, y0, x1, y1 = self.view
            return str(sum(1 for _, c, cx, cy, _ in self.shapes if c == color and x0 <= cx < x1 and y0 <= cy < y1))
        if name == "zoom":
            region = args.get("region")
            if region not in REGIONS:
                raise ToolError(f"zoom: region must be one of {list(REGIONS)}, got {region!r}")
            x0, y0, x1, y1 = self.view
            xm, ym = (x0 + x1) / 2, (y0 + y1) / 2
            self.view = {"top": (x0, y0, x1, ym), "bottom": (x0, ym, x1, y1),
                         "left": (x0, y0, xm, y1), "right": (xm, y0, x1, y1)}[region]
            return self.image()
        raise ToolError(f"unknown tool {name!r}; the tools are count and zoom")


def data_url(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def dataset(n: int, seed: int = 0) -> list[dict]:
    """``n`` episodes: a scene seed and the color to count (what ``ShapesAgent.run`` receives as ``data``)."""
    rng = random.Random(seed)
    return [{"scene_seed": rng.randrange(1 << 30), "color": rng.choice(list(COLORS))} for _ in range(n)]
