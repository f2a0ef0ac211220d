"""Sokoban: push every box onto a target. Rooms are generated per seed by reverse play, so every room is
solvable.

Generation (seeded): carve a connected room of floor by a random walk inside the walls, put the boxes on
targets and the player on a free cell, then play backwards: the player walks and *pulls* boxes, for
``num_pulls`` random moves. Each pull is a push undone, so pushing the boxes back along the same path
solves the room. Of several such backward plays in one room, the one that left the boxes furthest from
the targets is kept; a room where none moved a box is carved again.

The observation is the room, one row per line, in Sokoban's usual notation with ``_`` for floor:

    #######
    #__.__#
    #_$@__#
    #_____#
    #######

``#`` wall, ``_`` floor, ``.`` target, ``$`` box, ``*`` box on a target, ``@`` the player, ``+`` the player
on a target. A turn is one letter, ``L``, ``D``, ``R`` or ``U``; a move into a wall, or into a box that
cannot move, leaves the room as it was. Rewards (the usual ones): ``step_reward`` (-0.1) per move,
+1 for a box pushed onto a target, -1 for one pushed off, +10 when the room is solved (the episode
ends). A turn that is not one of the four letters gets ``invalid_action_reward`` and an observation that
says so; the episode goes on.
"""

from __future__ import annotations

import random
from typing import Any

from roll.envs.base import ENVIRONMENTS, TextEnv, invalid_action
from roll.envs.gym_adapter import DEFAULT_INVALID_ACTION_REWARD, action_parser

ACTIONS = ("L", "D", "R", "U")
MOVES = {"L": (0, -1), "D": (1, 0), "R": (0, 1), "U": (-1, 0)}
WALL, FLOOR, TARGET, BOX, BOX_ON_TARGET, PLAYER, PLAYER_ON_TARGET = "#", "_", ".", "$", "*", "@", "+"
ROOM_CHARS = (WALL, FLOOR, TARGET, BOX, BOX_ON_TARGET, PLAYER, PLAYER_ON_TARGET)
ACTION_HELP = "Answer with one letter: L, D, R or U."
Cell = tuple[int, int]
PLAYS_PER_ROOM = 8


def _check_options(
    size: int = 6, num_boxes: int = 1, num_pulls: int = 20, floor_share: float = 0.6, **_: object
) -> None:
    if not isinstance(size, int) or not 5 <= size <= 16:
        raise ValueError(f"environment 'sokoban': size must be an integer from 5 to 16, got {size!r}")
    inner = (size - 2) ** 2
    if not isinstance(num_boxes, int) or not 1 <= num_boxes <= max(1, inner // 4):
        raise ValueError(
            f"environment 'sokoban': num_boxes must be from 1 to {max(1, inner // 4)} for size {size}, "
            f"got {num_boxes!r}"
        )
    if not isinstance(num_pulls, int) or num_pulls < 1:
        raise ValueError(f"environment 'sokoban': num_pulls must be a positive integer, got {num_pulls!r}")
    if not 0.3 <= floor_share <= 1.0:
        raise ValueError(f"environment 'sokoban': floor_share must be in [0.3, 1], got {floor_share!r}")


class Room:
    """One Sokoban state: walls and targets fixed, boxes and player moving."""

    def __init__(
        self, shape: tuple[int, int], floor: set[Cell], targets: set[Cell], boxes: set[Cell], player: Cell
    ):
        self.shape, self.floor, self.targets = shape, floor, frozenset(targets)
        self.boxes, self.player = set(boxes), player

    @staticmethod
    def parse(observation: str) -> Room:
        """The room an observation shows (its grid lines; an ``Invalid action.`` line above is skipped)."""
        lines = [line for line in observation.splitlines() if line and set(line) <= set(ROOM_CHARS)]
        floor, targets, boxes, player = set(), set(), set(), None
        for r, line in enumerate(lines):
            for c, char in enumerate(line):
                if char != WALL:
                    floor.add((r, c))
                if char in (TARGET, BOX_ON_TARGET, PLAYER_ON_TARGET):
                    targets.add((r, c))
                if char in (BOX, BOX_ON_TARGET):
                    boxes.add((r, c))
                if char in (PLAYER, PLAYER_ON_TARGET):
                    player = (r, c)
        if player is None:
            raise ValueError(f"no player in the sokoban observation {observation!r}")
        return Room((len(lines), max(map(len, lines))), floor, targets, boxes, player)

    def copy(self) -> Room:
        return Room(self.shape, self.floor, set(self.targets), set(self.boxes), self.player)

    @property
    def solved(self) -> bool:
        return self.boxes == set(self.targets)

    def push(self, action: str) -> int:
        """Move the player (pushing a box ahead of it if the cell beyond is free); returns the change in
        boxes on targets (+1, 0 or -1)."""
        dr, dc = MOVES[action]
        ahead = (self.player[0] + dr, self.player[1] + dc)
        if ahead not in self.floor:
            return 0
        if ahead in self.boxes:
            beyond = (ahead[0] + dr, ahead[1] + dc)
            if beyond not in self.floor or beyond in self.boxes:
                return 0
            self.boxes.remove(ahead)
            self.boxes.add(beyond)
            self.player = ahead
            return int(beyond in self.targets) - int(ahead in self.targets)
        self.player = ahead
        return 0

    def render(self) -> str:
        rows = []
        height, width = self.shape
        for r in range(height):
            row = []
            for c in range(width):
                cell = (r, c)
                if cell not in self.floor:
                    row.append(WALL)
                elif cell == self.player:
                    row.append(PLAYER_ON_TARGET if cell in self.targets else PLAYER)
                elif cell in self.boxes:
                    row.append(BOX_ON_TARGET if cell in self.targets else BOX)
                else:
                    row.append(TARGET if cell in self.targets else FLOOR)
            rows.append("".join(row))
        return "\n".join(rows)


def generate_room(size: int, num_boxes: int, num_pulls: int, floor_share: float, seed: int) -> Room:
    """A solvable room for ``seed`` (see the module's docstring)."""
    rng = random.Random(seed)
    for _ in range(1000):
        floor = _carve(size, floor_share, rng)
        # Of several backward plays in the room, the one that took the boxes furthest from their targets.
        plays = [_reverse_play(floor, size, num_boxes, num_pulls, rng) for _ in range(PLAYS_PER_ROOM)]
        plays = [room for room in plays if room is not None]
        if plays:
            return max(plays, key=_displacement)
    raise RuntimeError(
        f"no sokoban room with {num_boxes} box(es) of size {size} after 1000 tries (seed {seed})"
    )


def _displacement(room: Room) -> int:
    """How far the boxes are from the targets: the sum over boxes of the distance to the nearest target."""
    return sum(min(abs(b[0] - t[0]) + abs(b[1] - t[1]) for t in room.targets) for b in room.boxes)


def _carve(size: int, floor_share: float, rng: random.Random) -> set[Cell]:
    """Connected floor cells inside the border walls, by a random walk, until ``floor_share`` of the
    inner cells are floor."""
    inner = [(r, c) for r in range(1, size - 1) for c in range(1, size - 1)]
    wanted = max(4, round(floor_share * len(inner)))
    cell = rng.choice(inner)
    floor = {cell}
    while len(floor) < wanted:
        dr, dc = MOVES[rng.choice(ACTIONS)]
        ahead = (cell[0] + dr, cell[1] + dc)
        if 1 <= ahead[0] < size - 1 and 1 <= ahead[1] < size - 1:
            cell = ahead
            floor.add(cell)
    return floor


def _reverse_play(
    floor: set[Cell], size: int, num_boxes: int, num_pulls: int, rng: random.Random
) -> Room | None:
    """Boxes on targets, then ``num_pulls`` random backward moves; None when no box left its target."""
    cells = sorted(floor)
    if len(cells) < num_boxes + 2:
        return None
    chosen = rng.sample(cells, num_boxes + 1)
    targets, player = set(chosen[:num_boxes]), chosen[num_boxes]
    room = Room((size, size), floor, targets, set(targets), player)
    for _ in range(num_pulls):
        dr, dc = MOVES[rng.choice(ACTIONS)]
        ahead = (room.player[0] + dr, room.player[1] + dc)
        if ahead not in floor or ahead in room.boxes:
            continue
        behind = (room.player[0] - dr, room.player[1] - dc)
        if behind in room.boxes:  # pull the box behind: a push undone
            room.boxes.remove(behind)
            room.boxes.add(room.player)
        room.player = ahead
    return None if room.solved else room


@ENVIRONMENTS.register("sokoban", check_options=_check_options)
class Sokoban(TextEnv):
    """Sokoban on a generated room per seed (see the module's docstring).

    Args:
        size: the room's side, walls included.
        num_boxes: boxes (and targets).
        num_pulls: backward moves when generating (more: boxes further from their targets).
        floor_share: the share of inner cells that are floor (the rest are walls).
        step_reward: the reward of every move.
        invalid_action_reward: the reward of a turn that is not one of L, D, R, U.
    """

    def __init__(
        self,
        size: int = 6,
        num_boxes: int = 1,
        num_pulls: int = 20,
        floor_share: float = 0.6,
        step_reward: float = -0.1,
        invalid_action_reward: float = DEFAULT_INVALID_ACTION_REWARD,
    ):
        _check_options(size, num_boxes, num_pulls, floor_share)
        self.size, self.num_boxes, self.num_pulls, self.floor_share = size, num_boxes, num_pulls, floor_share
        self.step_reward, self.invalid_action_reward = step_reward, invalid_action_reward
        self.parse = action_parser(ACTIONS)
        self.room: Room | None = None

    def room_for(self, seed: int) -> Room:
        return generate_room(self.size, self.num_boxes, self.num_pulls, self.floor_share, seed)

    def layout(self, seed: int) -> str:
        return self.room_for(seed).render()

    def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        self.room = self.room_for(seed)
        return self.room.render(), {}

    def step(self, action_text: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.room is None:
            raise RuntimeError("step() before reset()")
        action = self.parse(action_text)
        if action is None:
            return invalid_action(ACTION_HELP, self.room.render(), self.invalid_action_reward)
        placed = self.room.push(ACTIONS[action])
        solved = self.room.solved
        reward = self.step_reward + placed + (10.0 if solved else 0.0)
        info = {"action_is_valid": True, "metrics": {"success": float(solved)}}
        return self.room.render(), reward, solved, False, info


def solve(room: Room, max_states: int = 200_000) -> list[str] | None:
    """The shortest push-and-walk solution by breadth-first search (None if there is none within
    ``max_states`` states): tests verify generated rooms with it, and it is an expert to imitate."""
    from collections import deque

    start = (room.player, frozenset(room.boxes))
    seen = {start}
    queue = deque([(room.copy(), [])])
    while queue and len(seen) <= max_states:
        state, path = queue.popleft()
        if state.solved:
            return path
        for action in ACTIONS:
            nxt = state.copy()
            nxt.push(action)
            key = (nxt.player, frozenset(nxt.boxes))
            if key not in seen:
                seen.add(key)
                queue.append((nxt, [*path, action]))
    return None
