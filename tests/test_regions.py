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


def test_region_label_is_the_file_system_form_of_the_text_form():
    from rpa.core.regions import region_label

    assert region_label(parse_regions("swiglu,rope")) == region_label(frozenset({"rope", "swiglu"})) == "rope+swiglu"
    assert region_label(parse_regions("all")) == region_label(frozenset(REGIONS)) == "all"
    assert region_label(frozenset()) == region_label(parse_regions("none")) == "none"
    assert region_label(frozenset({"rmsnorm", "rope"})) == "rope+rmsnorm"  # REGIONS order, whatever the set's


@pytest.mark.parametrize("regions", ["all", "rope,swiglu", {"rope"}, ("rope",), frozenset({"rope", "attention"})])
def test_only_a_region_set_is_formatted_text_is_not_read_as_one(regions):
    """Text is read by parse_regions alone: the formats refuse it (once region_label parsed text
    itself), as they refuse a set of unknown names."""
    from rpa.core.regions import region_label, to_env

    for form in (format_regions, region_label, to_env):
        with pytest.raises(RegionError, match="frozenset|unknown region"):
            form(regions)


@pytest.mark.parametrize("spec", ["none", "all", "rope", "rope,swiglu", "swiglu,rmsnorm"])
def test_the_environment_variable_carries_the_text_form_and_reads_back(spec):
    from rpa.core.regions import ENV_VAR, from_env, to_env

    regions = parse_regions(spec)
    assert to_env(regions) == {"RPA_REGIONS": spec} and ENV_VAR == "RPA_REGIONS"
    assert from_env(to_env(regions)) == regions


@pytest.mark.parametrize("environ", [{}, {"RPA_REGIONS": ""}, {"RPA_REGIONS": "  "}, {"RPA_REGIONS": "none"}])
def test_an_unset_or_empty_environment_variable_is_stock_vllm(environ):
    from rpa.core.regions import from_env

    assert from_env(environ) == frozenset()


def test_a_misspelt_environment_variable_is_refused_as_text_is():
    from rpa.core.regions import from_env

    with pytest.raises(RegionError, match="write 'rope,swiglu'"):
        from_env({"RPA_REGIONS": "rope, swiglu"})


@pytest.mark.parametrize("spec", ["", "  "])
def test_an_empty_region_set_is_refused_not_read_as_none(spec):
    with pytest.raises(RegionError, match="empty region set.*write 'none'"):
        parse_regions(spec)


@pytest.mark.parametrize("spec,write", [("NONE", "none"), ("ROPE", "rope"), ("rope, swiglu", "rope,swiglu"),
                                        (" all", "all"), ("Rope,SwiGLU", "rope,swiglu")])
def test_one_spelling_other_cases_and_spaces_are_refused_with_the_one_to_write(spec, write):
    with pytest.raises(RegionError, match=f"write '{write}'"):
        parse_regions(spec)
