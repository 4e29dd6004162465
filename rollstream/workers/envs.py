"""Text environments for agentic rollouts, behind one small interface (``TextEnv``).

An environment speaks text both ways: ``reset(seed)`` returns the first observation (rules and
state, everything the model needs to act), ``step(action_text)`` takes the model's raw answer and
returns a ``StepResult``. Parsing the action out of free text is the environment's job, so the
episode logic never knows which game it plays.

Built in (rollstream.extensions.ENVIRONMENTS):

* ``frozen_lake`` -- gymnasium's FrozenLake-v1 rendered as a text grid. The action is the last
  move named in the answer (see ``parse_action``); an answer naming none is an invalid move that
  leaves the state unchanged with reward 0.
* ``frozen_lake_textarena``, ``sokoban`` -- textarena 0.7.4's FrozenLake-v0 and Sokoban-v0.
  textarena parses and judges the move itself (two invalid moves in a row end its game); its
  refusals come back as ``invalid_move=True``.

Anything else is an import path ``"pkg.module:Class"`` built as ``Class(**env_config)``.

Every method of an environment is called from one thread at a time, but not always the same
thread (the env worker runs them in helper threads).
"""

from __future__ import annotations

import importlib
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

from rollstream.exceptions import ConfigError
from rollstream.extensions import ENVIRONMENTS


@dataclass(frozen=True)
class StepResult:
    """The environment's answer to one action.

    ``observation``: text shown to the model next. ``reward``: this step's reward (float).
    ``done``: the episode is over. ``invalid_move``: the action did not parse or the game refused
    it. ``success``: the episode ended in a win (only meaningful when ``done``). ``action``: the
    action as the environment understood it; "" when it could not parse one.
    """

    observation: str
    reward: float = 0.0
    done: bool = False
    invalid_move: bool = False
    success: bool = False
    action: str = ""


@runtime_checkable
class TextEnv(Protocol):
    """A text game played by one model."""

    def reset(self, seed: int) -> str:
        """Start an episode; same seed -> same episode. Returns the first observation."""
        ...

    def step(self, action_text: str) -> StepResult:
        """Apply the model's raw answer. Behaviour after ``done`` is undefined."""
        ...

    def close(self) -> None:
        """Release resources; the environment is not used afterwards."""
        ...


# -- action parsing ---------------------------------------------------------------------------

def parse_action(text: str, actions: Sequence[str]) -> str | None:
    """The action ``text`` names, or None.

    Rules: bracketed names (``[down]``, spaces inside the brackets allowed) win over plain words;
    among several, the LAST one counts (models tend to reason first, answer last). Plain words
    must stand alone (``up`` does not match in ``upper``). Matching ignores case; the result is
    the name as spelled in ``actions``.
    """
    if not actions:
        return None
    by_lower = {a.lower(): a for a in actions}
    names = "|".join(re.escape(a) for a in sorted(by_lower, key=len, reverse=True))
    bracketed = re.findall(rf"\[\s*({names})\s*\]", text, flags=re.IGNORECASE)
    if bracketed:
        return by_lower[bracketed[-1].lower()]
    plain = re.findall(rf"(?<![A-Za-z0-9_])({names})(?![A-Za-z0-9_])", text, flags=re.IGNORECASE)
    if plain:
        return by_lower[plain[-1].lower()]
    return None


# -- gymnasium FrozenLake -----------------------------------------------------------------------

class GymFrozenLake:
    """gymnasium ``FrozenLake-v1`` as a text game.

    ``env_config`` goes to ``gymnasium.make`` (``map_name``, ``is_slippery``, ``desc``,
    ``max_episode_steps`` ...). Reward 1.0 on reaching the goal, else 0; ``success`` = goal
    reached. Raises whatever gymnasium raises for bad arguments (TypeError, ValueError).
    """

    ACTIONS = ("left", "down", "right", "up")  # gymnasium's action ids 0..3
    library = "gymnasium"  # resolve_env imports it when the worker starts

    def __init__(self, **env_config: Any) -> None:
        # Each environment library is imported when an environment of it is built: an env worker
        # loads only the library its requests name (resolve_env warms it up at start).
        import gymnasium as gym

        self._env = gym.make("FrozenLake-v1", render_mode="ansi", **env_config)
        lake = self._env.unwrapped
        self._desc = [[c.decode() for c in row] for row in lake.desc]
        self._nrow, self._ncol = lake.nrow, lake.ncol
        # Slippery lakes have several possible outcomes per (state, action).
        self._slippery = any(len(outcomes) > 1 for moves in lake.P.values() for outcomes in moves.values())
        self._state = 0
        self._done = False

    def _grid(self) -> str:
        row, col = divmod(self._state, self._ncol)
        lines = []
        for r, cells in enumerate(self._desc):
            lines.append(" ".join("P" if (r, c) == (row, col) else cell for c, cell in enumerate(cells)))
        return "\n".join(lines)

    def _moves_hint(self) -> str:
        return ", ".join(f"[{a}]" for a in self.ACTIONS)

    def reset(self, seed: int) -> str:
        state, _ = self._env.reset(seed=int(seed))
        self._state, self._done = int(state), False
        slippery = " The ice is slippery: you may slide sideways instead of where you chose." if self._slippery else ""
        return (
            f"You are on a frozen lake, a {self._nrow}x{self._ncol} grid. Walk to the goal G "
            f"without stepping into a hole H.{slippery}\n"
            "Symbols: P = you, S = start, F = frozen ice (safe), H = hole, G = goal.\n"
            f"Answer with one move in square brackets: {self._moves_hint()}.\n\n"
            f"Grid:\n{self._grid()}"
        )

    def step(self, action_text: str) -> StepResult:
        action = parse_action(action_text, self.ACTIONS)
        if action is None:
            # The lake is untouched: the model gets another try at the same state.
            return StepResult(
                observation=(f"Invalid move: your answer names no move. Answer with one of "
                             f"{self._moves_hint()}. You did not move.\n\nGrid:\n{self._grid()}"),
                invalid_move=True,
            )
        state, reward, terminated, truncated, _ = self._env.step(self.ACTIONS.index(action))
        self._state = int(state)
        row, col = divmod(self._state, self._ncol)
        cell = self._desc[row][col]
        success = bool(terminated and cell == "G")
        text = f"You chose [{action}]. You are now at row {row + 1}, column {col + 1}."
        if terminated:
            text += " You reached the goal!" if success else " You fell into a hole. Game over."
        elif truncated:
            text += " You are out of moves. Game over."
        self._done = bool(terminated or truncated)
        return StepResult(observation=f"{text}\n\nGrid:\n{self._grid()}", reward=float(reward),
                          done=self._done, success=success, action=action)

    def close(self) -> None:
        self._env.close()


# -- textarena ----------------------------------------------------------------------------------

# textarena seeds the process-global ``random`` module in reset and FrozenLake-v0 draws its map
# from it: concurrent resets would interleave draws and break same seed -> same map.
_TEXTARENA_RESET_LOCK = threading.Lock()
_WASD = {"w": "up", "a": "left", "s": "down", "d": "right"}


class TextArenaEnv:
    """A single-player textarena 0.7.4 game (``ta.make(game_id, **env_config)``).

    The model sees only what is new each turn (the chat already holds the history), so the
    observations are read from the unwrapped game, skipping textarena's history-accumulating
    observation wrapper; actions still pass through its action wrappers (brackets are added to
    a bare answer). The move is parsed with ``parse_action`` like every other environment and
    sent as ``[move]``; ``invalid_move`` mirrors textarena's own verdict; the reward is the game's
    final reward, given on the step that ends it (textarena shapes it: partial progress scores
    in (0, 1)); ``success`` = the game ended with reward >= 1. ``action`` is the move sent
    (up/down/left/right), "" for refused moves or text naming none.
    """

    # w/a/s/d count only in brackets ("a" in prose is a word); bracketed moves win anyway.
    MOVES = ("up", "down", "left", "right")

    def __init__(self, game_id: str, **env_config: Any) -> None:
        import textarena as ta  # imported when used, like gymnasium above
        from textarena.core import Wrapper

        self._ta = ta
        self._env = ta.make(game_id, **env_config)
        base = self._env
        while isinstance(base, Wrapper):
            base = base.env
        self._base = base

    def _new_messages(self) -> str:
        _, messages = self._base.get_observation()
        parts = [msg for _, msg, kind in messages if kind != self._ta.ObservationType.PLAYER_ACTION]
        return "\n\n".join(p.strip() for p in parts if p.strip())

    def reset(self, seed: int) -> str:
        with _TEXTARENA_RESET_LOCK:
            self._env.reset(num_players=1, seed=int(seed))
        return self._new_messages()

    def step(self, action_text: str) -> StepResult:
        # One parser for every environment: the move the text names (bracketed or a plain word,
        # the last one counts) is sent as "[move]"; a text naming none goes as it is and the game
        # refuses it (an invalid move), as it would the model's raw text.
        move = parse_action(action_text, self.MOVES + tuple(_WASD))
        if move is not None and move in _WASD and f"[{move}" not in action_text.lower().replace(" ", ""):
            move = parse_action(action_text, self.MOVES)  # a lone "a"/"s" in prose is a word, not a move
        move = _WASD.get(move, move)
        done, _ = self._env.step(action=f"[{move}]" if move else action_text)
        state = self._base.state
        info = state.game_info.get(0, {})
        # SinglePlayerState keeps error_count > 0 after a refused move it forgave; a refused move
        # that ends the game is flagged in game_info instead.
        invalid = bool(info.get("invalid_move")) if done else getattr(state, "error_count", 0) > 0
        reward = float((state.rewards or {}).get(0, 0.0)) if done else 0.0
        text = self._new_messages()
        if done and info.get("reason"):
            text = f"{text}\n\n{info['reason']}" if text else str(info["reason"])
        action = "" if invalid or move is None else move
        return StepResult(observation=text, reward=reward, done=bool(done), invalid_move=invalid,
                          success=bool(done and reward >= 1.0), action=action)

    def close(self) -> None:
        self._env.close()


# -- registry -----------------------------------------------------------------------------------

EnvFactory = Callable[..., TextEnv]


def textarena_frozen_lake(**env_config: Any) -> TextEnv:
    """textarena's FrozenLake-v0 (``env_type: frozen_lake_textarena``)."""
    return TextArenaEnv("FrozenLake-v0", **env_config)


def textarena_sokoban(**env_config: Any) -> TextEnv:
    """textarena's Sokoban-v0 (``env_type: sokoban``)."""
    return TextArenaEnv("Sokoban-v0", **env_config)


textarena_frozen_lake.library = textarena_sokoban.library = "textarena"  # type: ignore[attr-defined]


def resolve_env(env_type: str) -> EnvFactory:
    """The constructor behind ``env_type`` (rollstream.extensions.ENVIRONMENTS; called as
    ``factory(**env_config)``). A built-in's library is imported now, so a later construction is
    cheap. Raises ConfigError for an unknown, renamed or unimportable name, or a class without
    reset/step/close."""
    factory = ENVIRONMENTS.get_named(env_type)
    library = getattr(factory, "library", None)
    if library is not None:
        importlib.import_module(library)
    return factory


def make_env(env_type: str, env_config: dict[str, Any] | None = None) -> TextEnv:
    """Build the environment ``env_type`` with constructor arguments ``env_config``.

    Raises ConfigError for an unknown ``env_type`` (the message lists the known names) or an
    object that lacks reset/step/close; constructor errors propagate unchanged.
    """
    env = resolve_env(env_type)(**(env_config or {}))
    if not isinstance(env, TextEnv):
        raise ConfigError(f"env_type {env_type!r} built a {type(env).__name__}, which lacks reset/step/close")
    return env
