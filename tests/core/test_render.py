import struct

import jinja2
import pytest

import flashgen
from flashgen.kernels import ParamsLayout, Param, TemplateError, family, render_template
from flashgen.kernels.render import environment
from flashgen.spec import AttentionSpec, MergeSpec, SpecError


def test_params_layout_follows_c_alignment():
    layout = ParamsLayout.of("P", (Param("a", "int32_t"), Param("p", "const float*"), Param("b", "float"),
                                   Param("n", "int64_t"), Param("c", "int32_t")))
    assert layout.offsets == (0, 8, 16, 24, 32)
    assert layout.size == 40
    assert struct.calcsize(layout.format) == layout.size


def test_params_layout_rejects_unknown_types():
    with pytest.raises(ValueError, match="unsupported C type"):
        ParamsLayout.of("P", (Param("x", "half"),))


def test_render_merge_declares_structs_with_static_asserts():
    source = flashgen.render(MergeSpec("bfloat16"), "merge_states")
    assert "using DTypeV = __nv_bfloat16;" in source
    assert "static_assert(sizeof(MergeStateParams) == 80" in source
    assert 'extern "C" __global__' in source
    assert "{{" not in source and "{%" not in source


def test_attention_spec_projects_to_fp32_merge():
    assert family("merge_states").uri(family("merge_states").project(AttentionSpec(128))) == "merge_states_f32"


def test_unknown_op_is_a_spec_error():
    with pytest.raises(SpecError, match="op: got 'nope'"):
        flashgen.render(MergeSpec(), "nope")


def test_environment_is_strict():
    assert environment().undefined is jinja2.StrictUndefined


def test_missing_variable_names_template_line_and_uri():
    with pytest.raises(TemplateError) as info:
        render_template("merge_states.cu.j2", {"structs": [], "entry_points": []}, "merge_states_test")
    message = str(info.value)
    assert message.startswith("merge_states.cu.j2:") and "merge_states_test" in message
    assert "undefined" in message and ":?:" not in message
