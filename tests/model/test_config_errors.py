"""``get_preset`` and ``ModelConfig`` errors a library caller meets: one line, with the name meant."""
from __future__ import annotations

import pytest

import aiayn
from aiayn.config import ConfigError


@pytest.mark.parametrize("name, meant", [("bsae", "base"), ("Base", "base"), ("BIG", "big"), ("e", "E"),
                                         ("tiny ", "tiny")])
def test_an_unknown_preset_names_the_close_one(name, meant):
    with pytest.raises(ConfigError, match=rf"^unknown preset {name!r}; known: base, A1, .*, multi30k; "
                                          rf"did you mean {meant}\?$"):
        aiayn.get_preset(name)
    with pytest.raises(ConfigError, match=r"^unknown preset 'xyzzy'; known: base, .*, multi30k$"):  # none is close
        aiayn.get_preset("xyzzy")


@pytest.mark.parametrize("value, says", [(64.5, "expected an int in"), (True, "expected an int in"),
                                         (1e9, "outside"), (0, "outside"), ("x", "expected an int in")])
def test_a_size_that_is_not_a_whole_number_is_not_called_out_of_range(value, says):
    """64.5 lies inside [1, 1,048,576]: what is wrong with it is its type."""
    with pytest.raises(ConfigError, match=rf"^d_ff = {value!r}: {says} \[1, 1,048,576\]$"):
        aiayn.ModelConfig(d_ff=value)


@pytest.mark.parametrize("key, meant", [("P_DROP", "p_drop"), ("D_Model", "d_model"), ("p_dorp", "p_drop")])
def test_an_unknown_field_names_the_close_one_in_any_case(key, meant):
    """A field named in another case (a recipe written in capitals) is a typo too, as a preset's name."""
    with pytest.raises(ConfigError, match=rf"^unknown field {key!r} in ModelConfig; did you mean {meant}\?$"):
        aiayn.config.replace(aiayn.ModelConfig(), **{key: 0.1})


def test_an_unknown_field_far_from_all_lists_them():
    with pytest.raises(ConfigError, match=r"^unknown field 'zzz' in ModelConfig; known: .*\bd_model\b.*\bp_drop\b"):
        aiayn.config.replace(aiayn.ModelConfig(), zzz=1)
