"""FrozenLake through Gymnasium: its map generator and dynamics, rendered as a text grid.

The seed makes the map (``generate_random_map(size, p, seed)``, which always has a path from start to
goal) and seeds the slips, so a seed is a task. The observation is the grid, one row per line:

    P___
    _H_H
    ___H
    H__G

``P`` the player, ``_`` frozen ice, ``H`` a hole (the episode ends, reward 0), ``G`` the goal (the
episode ends, reward 1). A turn is one letter: ``L``, ``D``, ``R`` or ``U`` (left, down, right, up;
case and surrounding whitespace ignored). With ``slippery``, a move goes the intended way with
probability ``success_rate`` and sideways otherwise (Gymnasium's rule).

With ``render="image"`` the policy sees the grid as a picture instead (an ``ImageObservation``, for a
vision-language model): each cell a ``CELL_PIXELS`` square (one image token of Qwen2-VL, whose tokens are
28x28 pixels), ice light, holes dark, the goal green, the player red.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from roll.envs.base import ENVIRONMENTS, ImageObservation, Observation
from roll.envs.gym_adapter import DEFAULT_INVALID_ACTION_REWARD, GymnasiumTextEnv, action_parser

ACTIONS = ("L", "D", "R", "U")  # Gymnasium's order: 0 left, 1 down, 2 right, 3 up
MOVES = {"L": (0, -1), "D": (1, 0), "R": (0, 1), "U": (-1, 0)}
PLAYER, ICE, HOLE, GOAL = "P", "_", "H", "G"
RENDERS = ("text", "image")
CELL_PIXELS = 28
COLOURS = {PLAYER: (220, 40, 40), ICE: (225, 235, 250), HOLE: (25, 35, 80), GOAL: (40, 170, 60)}


def _check_options(
    size: int = 4,
    frozen_prob: float = 0.8,
    slippery: bool = False,
    success_rate: float = 1 / 3,
    render: str = "text",
    **_: object,
) -> None:
    if render not in RENDERS:
        raise ValueError(
            f"environment 'frozen_lake': render must be one of {', '.join(RENDERS)}, got {render!r}"
        )
    if not isinstance(size, int) or not 2 <= size <= 32:
        raise ValueError(f"environment 'frozen_lake': size must be an integer from 2 to 32, got {size!r}")
    if not 0.0 < frozen_prob <= 1.0:
        raise ValueError(f"environment 'frozen_lake': frozen_prob must be in (0, 1], got {frozen_prob!r}")
    if not 0.0 <= success_rate <= 1.0:
        raise ValueError(f"environment 'frozen_lake': success_rate must be in [0, 1], got {success_rate!r}")


@ENVIRONMENTS.register("frozen_lake", check_options=_check_options)
class FrozenLake(GymnasiumTextEnv):
    """FrozenLake on a random map per seed.

    Args:
        size: the map's side (4: 4x4).
        frozen_prob: the share of ice among the cells that are not start or goal (Gymnasium's ``p``).
        slippery: moves may slip sideways.
        success_rate: with ``slippery``, the probability that a move goes the intended way.
        invalid_action_reward: the reward of a turn that is not one of L, D, R, U.
        render: "text" (the grid as letters) or "image" (the grid as a picture, for a vision-language
            policy).
    """

    def __init__(
        self,
        size: int = 4,
        frozen_prob: float = 0.8,
        slippery: bool = False,
        success_rate: float = 1 / 3,
        invalid_action_reward: float = DEFAULT_INVALID_ACTION_REWARD,
        render: str = "text",
    ):
        _check_options(size, frozen_prob, slippery, success_rate, render)
        self.size, self.frozen_prob = size, frozen_prob
        self.slippery, self.success_rate = slippery, success_rate
        show = render_picture if render == "image" else (lambda grid: grid)
        super().__init__(
            make=self._make,
            render=lambda env, state: show(render_grid(env.unwrapped.desc, int(state))),
            parse_action=action_parser(ACTIONS),
            action_help="Answer with one letter: L, D, R or U.",
            invalid_action_reward=invalid_action_reward,
        )

    def layout(self, seed: int) -> str:
        from gymnasium.envs.toy_text.frozen_lake import generate_random_map

        return "\n".join(generate_random_map(size=self.size, p=self.frozen_prob, seed=seed))

    def _make(self, seed: int) -> Any:
        from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv

        return FrozenLakeEnv(
            desc=self.layout(seed).split("\n"), is_slippery=self.slippery, success_rate=self.success_rate
        )

    def step(self, action_text: str):
        observation, reward, terminated, truncated, info = super().step(action_text)
        if info["action_is_valid"]:
            info["metrics"] = {"success": float(terminated and reward > 0)}
        return observation, reward, terminated, truncated, info


def render_grid(desc: Any, state: int) -> str:
    """The map ``desc`` (Gymnasium's array of byte letters S, F, H, G) with the player at ``state``."""
    rows = [[cell.decode() if isinstance(cell, bytes) else str(cell) for cell in row] for row in desc]
    width = len(rows[0])
    lines = []
    for r, row in enumerate(rows):
        cells = [{"S": ICE, "F": ICE, "H": HOLE, "G": GOAL}[c] for c in row]
        if r == state // width:
            cells[state % width] = PLAYER
        lines.append("".join(cells))
    return "\n".join(lines)


def render_picture(grid: str) -> Observation:
    """The rendered ``grid`` as a picture (PNG), one ``CELL_PIXELS`` square per cell, with the grid as
    the observation's state."""
    import io

    from PIL import Image, ImageDraw

    rows = grid.split("\n")
    picture = Image.new("RGB", (len(rows[0]) * CELL_PIXELS, len(rows) * CELL_PIXELS))
    draw = ImageDraw.Draw(picture)
    for r, row in enumerate(rows):
        for c, cell in enumerate(row):
            left, top = c * CELL_PIXELS, r * CELL_PIXELS
            draw.rectangle([left, top, left + CELL_PIXELS - 1, top + CELL_PIXELS - 1], fill=COLOURS[cell])
    encoded = io.BytesIO()
    picture.save(encoded, format="PNG")
    return ImageObservation("", (encoded.getvalue(),), grid)


def shortest_path(grid: str) -> list[str] | None:
    """The letters of a shortest path from ``P`` to ``G`` around the holes of a rendered grid (the last
    lines of ``grid`` made only of grid cells), or None when there is none."""
    rows = [line for line in grid.split("\n") if line and set(line) <= {PLAYER, ICE, HOLE, GOAL}]
    cells = {(r, c): ch for r, line in enumerate(rows) for c, ch in enumerate(line)}
    start = next((p for p, ch in cells.items() if ch == PLAYER), None)
    if start is None:
        return None
    paths: dict[tuple[int, int], list[str]] = {start: []}
    queue = deque([start])
    while queue:
        here = queue.popleft()
        if cells[here] == GOAL:
            return paths[here]
        for letter, (dr, dc) in MOVES.items():
            there = (here[0] + dr, here[1] + dc)
            if there in cells and there not in paths and cells[there] != HOLE:
                paths[there] = paths[here] + [letter]
                queue.append(there)
    return None
