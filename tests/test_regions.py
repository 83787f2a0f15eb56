import pytest

from rpa.core.regions import REGIONS, RegionError, format_regions, parse_regions


@pytest.mark.parametrize("spec,want", [
    (None, set()), ("none", set()),
    ("all", set(REGIONS)), ("rope", {"rope"}), ("rope,swiglu", {"rope", "swiglu"}),
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


def test_region_label_is_the_file_system_form_of_either_representation():
    from rpa.core.regions import region_label

    assert region_label("swiglu,rope") == region_label(frozenset({"rope", "swiglu"})) == "rope+swiglu"
    assert region_label("all") == region_label(frozenset(REGIONS)) == "all"
    assert region_label(frozenset()) == region_label("none") == "none"


@pytest.mark.parametrize("spec", ["", "  "])
def test_an_empty_region_set_is_refused_not_read_as_none(spec):
    with pytest.raises(RegionError, match="empty region set.*write 'none'"):
        parse_regions(spec)


@pytest.mark.parametrize("spec,write", [("NONE", "none"), ("ROPE", "rope"), ("rope, swiglu", "rope,swiglu"),
                                        (" all", "all"), ("Rope,SwiGLU", "rope,swiglu")])
def test_one_spelling_other_cases_and_spaces_are_refused_with_the_one_to_write(spec, write):
    with pytest.raises(RegionError, match=f"write '{write}'"):
        parse_regions(spec)
