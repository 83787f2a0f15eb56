import pytest

from rpa.core.regions import REGIONS, RegionError, format_regions, parse_regions


@pytest.mark.parametrize("spec,want", [
    (None, set()), ("", set()), ("none", set()), ("NONE", set()),
    ("all", set(REGIONS)), ("rope", {"rope"}), ("rope, swiglu", {"rope", "swiglu"}),
    ("rmsnorm,rope,swiglu", set(REGIONS)),
])
def test_parse(spec, want):
    assert parse_regions(spec) == want


@pytest.mark.parametrize("spec", ["rope,bogus", "layernorm", "all,rope", "rope,,swiglu", "rope,rope"])
def test_bad_names_list_valid_ones(spec):
    with pytest.raises(RegionError) as err:
        parse_regions(spec)
    for name in ("'none'", "'all'", *REGIONS):
        assert name in str(err.value)


@pytest.mark.parametrize("spec", ["none", "all", "rope", "swiglu", "rmsnorm", "rope,swiglu", "swiglu,rmsnorm"])
def test_format_roundtrip(spec):
    assert format_regions(parse_regions(spec)) == spec
