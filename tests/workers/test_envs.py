"""Text environments: action parsing, gymnasium FrozenLake, textarena games, the registry."""

from __future__ import annotations

import os
import threading

import pytest

from rollstream.exceptions import ConfigError
from rollstream.workers.envs import GymFrozenLake, StepResult, TextEnv, make_env, parse_action

from .fault_envs import CountingEnv

# the hint of a module that is not found (rollstream.registry.import_object)
LOOKED_UP = f" (looked up beside the config file, in the working directory {os.getcwd()} and in the installed packages)"

MOVES = GymFrozenLake.ACTIONS


@pytest.mark.parametrize(
    "text, expected",
    [
        ("[down]", "down"),
        ("[ Down ]", "down"),
        ("I think up, then [left]", "left"),  # a bracketed move beats plain words
        ("[up] is tempting but [right]", "right"),  # the last bracketed move counts
        ("[up] then down", "up"),
        ("go down now", "down"),
        ("left or right? right.", "right"),  # the last plain word counts
        ("UP!", "up"),
        ("upper leftmost", None),  # words must stand alone
        ("[jump]", None),
        ("", None),
        ("[down", "down"),  # an unclosed bracket still names a plain word
    ],
)
def test_parse_action(text, expected):
    assert parse_action(text, MOVES) == expected


def test_parse_action_keeps_the_given_spelling_and_handles_no_actions():
    assert parse_action("[GO]", ["Go", "Stop"]) == "Go"
    assert parse_action("[down]", []) is None


def _position(observation: str) -> tuple[int, int]:
    grid = observation.split("Grid:\n", 1)[1].splitlines()
    for r, line in enumerate(grid):
        cells = line.split()
        if "P" in cells:
            return r, cells.index("P")
    raise AssertionError(f"no P in {observation!r}")


def test_gym_frozenlake_scripted_path_reaches_the_goal():
    env = make_env("frozen_lake", {"is_slippery": False})
    assert isinstance(env, TextEnv)
    first = env.reset(seed=3)
    assert "4x4 grid" in first and "[left], [down], [right], [up]" in first
    assert first.endswith("Grid:\nP F F F\nF H F H\nF F F H\nH F F G")
    assert "slippery" not in first
    script = ["[right]", "I go right", "[down]", "then [down]", "down", "so [right]!"]
    positions = [(0, 1), (0, 2), (1, 2), (2, 2), (3, 2), (3, 3)]
    results = []
    for text, pos in zip(script, positions):
        res = env.step(text)
        results.append(res)
        assert _position(res.observation) == pos
    assert [r.action for r in results] == ["right", "right", "down", "down", "down", "right"]
    assert [r.reward for r in results] == [0.0] * 5 + [1.0]
    assert [r.done for r in results] == [False] * 5 + [True]
    assert results[-1].success and not any(r.success for r in results[:-1])
    assert not any(r.invalid_move for r in results)
    assert "You reached the goal!" in results[-1].observation
    env.close()


def test_gym_frozenlake_invalid_text_leaves_the_state_unchanged():
    env = make_env("frozen_lake", {"is_slippery": False})
    env.reset(seed=0)
    moved = env.step("[down]")
    assert _position(moved.observation) == (1, 0)
    bad = env.step("I am not sure what to do")
    assert bad == StepResult(observation=bad.observation, reward=0.0, done=False, invalid_move=True,
                             success=False, action="")
    assert bad.observation.startswith("Invalid move")
    assert _position(bad.observation) == (1, 0)
    # the lake really did not move: the next move starts from (1, 0)
    assert _position(env.step("[down]").observation) == (2, 0)
    hole = env.step("[down]")  # (3, 0) is a hole
    assert (hole.done, hole.success, hole.reward, hole.invalid_move) == (True, False, 0.0, False)
    assert "fell into a hole" in hole.observation


def test_gym_frozenlake_passes_env_config_through():
    env = make_env("frozen_lake", {"map_name": "8x8", "is_slippery": True})
    first = env.reset(seed=1)
    assert "8x8 grid" in first and "slippery" in first
    assert len(first.split("Grid:\n", 1)[1].splitlines()) == 8
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_arg'"):  # the env's own error
        make_env("frozen_lake", {"no_such_arg": 1})


@pytest.mark.parametrize("env_type", ["frozen_lake_textarena", "sokoban"])
def test_textarena_same_seed_same_first_observation(env_type):
    firsts = [make_env(env_type).reset(seed=s) for s in (5, 5, 6, 7, 8)]
    assert firsts[0] == firsts[1]
    assert len(set(firsts[1:])) > 1  # other seeds give other maps
    assert "Current Board" in firsts[0] and "You are" in firsts[0]


def test_textarena_resets_in_threads_stay_deterministic():
    # textarena seeds the global `random` module: concurrent resets must not mix their draws
    expected = make_env("frozen_lake_textarena").reset(seed=11)
    envs = [make_env("frozen_lake_textarena") for _ in range(6)]
    seen: list[str] = []
    threads = [threading.Thread(target=lambda e=e: seen.append(e.reset(seed=11))) for e in envs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert seen == [expected] * 6


def test_textarena_frozenlake_moves_and_invalid_moves():
    env = make_env("frozen_lake_textarena")
    env.reset(seed=5)
    first_bad = env.step("no idea")
    assert (first_bad.invalid_move, first_bad.done, first_bad.reward, first_bad.action) == (True, False, 0.0, "")
    assert "invalid move" in first_bad.observation.lower()
    moved = env.step("I pick [d]")  # wasd alias for right; a move after a refused one is fine
    assert (moved.invalid_move, moved.action, moved.done, moved.reward) == (False, "right", False, 0.0)
    assert moved.observation.startswith("You moved right to position (0, 1).")
    # seed 5: holes at (1, 1), (2, 2), (3, 0); along the top row, then down the right edge
    results = [env.step(a) for a in ("[right]", "[right]", "[down]", "[down]", "[down]")]
    assert [r.done for r in results] == [False] * 4 + [True]
    assert (results[-1].reward, results[-1].success) == (1.0, True)
    assert "Congratulations! You reached the goal!" in results[-1].observation
    env.close()


def test_textarena_two_refusals_in_a_row_end_the_game():
    env = make_env("sokoban")
    env.reset(seed=3)
    first = env.step("hmm")
    second = env.step("hmm again")
    assert (first.invalid_move, first.done) == (True, False)
    assert (second.invalid_move, second.done, second.success) == (True, True, False)
    assert "Invalid Move" in second.observation
    assert 0.0 <= second.reward < 1.0


def test_textarena_bare_answer_gets_brackets():
    env = make_env("frozen_lake_textarena")
    env.reset(seed=5)
    res = env.step("down")  # textarena's ActionFormattingWrapper turns it into [down]
    assert (res.invalid_move, res.action) == (False, "down")


def test_a_bad_env_type_names_the_known_ones_or_what_failed_to_import():
    for bad, message in (
            ("FrozenLake", "unknown env_type 'FrozenLake'; valid: ['frozen_lake', 'frozen_lake_textarena', 'sokoban'] "
                           "or an import path 'pkg.module:name'"),
            ("textarena:Chess-v0", "cannot import env_type 'textarena:Chess-v0': module 'textarena' has no attribute "
                                   "'Chess-v0'"),
            ("no_such_module_xyz:Env", "cannot import env_type 'no_such_module_xyz:Env': module 'no_such_module_xyz': "
                                       f"ModuleNotFoundError: No module named 'no_such_module_xyz'{LOOKED_UP}"),
            ("tests.workers.fault_envs:Missing", "cannot import env_type 'tests.workers.fault_envs:Missing': module "
                                                 "'tests.workers.fault_envs' has no attribute 'Missing'"),
            ("gym:FrozenLake-v1", "env_type 'gym:FrozenLake-v1' is now spelled 'frozen_lake'")):
        with pytest.raises(ConfigError) as info:
            make_env(bad, {})
        assert str(info.value) == message


def test_import_path_env_is_built_with_env_config():
    env = make_env("tests.workers.fault_envs:CountingEnv", {"episode_len": 3, "reward": 2.0})
    assert isinstance(env, CountingEnv) and env.episode_len == 3
    assert env.reset(seed=9) == "Episode 9. Say anything, e.g. [go]."
    assert [env.step("x").done for _ in range(3)] == [False, False, True]
    with pytest.raises(ConfigError, match=r"NotAnEnv' is a class \(it lacks reset, step, close\), not an environment class"):
        make_env("tests.workers.fault_envs:NotAnEnv", {})
    with pytest.raises(ValueError, match="fail_on"):
        make_env("tests.workers.fault_envs:FailingEnv", {"fail_on": "close"})


@pytest.mark.parametrize("text, action, invalid", [
    ("I think a good move is down.", "down", False),  # a plain move word, like every environment
    ("Move [s]", "down", False),  # bracketed wasd alias
    ("Let me go right", "right", False),
    ("a s d", "", True),  # lone letters in prose are words, not moves
    ("no idea at all", "", True),
])
def test_textarena_moves_use_the_shared_parser(text, action, invalid):
    env = make_env("frozen_lake_textarena", {})
    try:
        env.reset(seed=1)
        result = env.step(text)
    finally:
        env.close()
    assert (result.action, result.invalid_move) == (action, invalid)
