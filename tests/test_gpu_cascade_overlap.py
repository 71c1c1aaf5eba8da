"""scripts/gpu_cascade_overlap.py's cases and forms (the timing and the stream arrangements need
a GPU; the passes' equality in turn and side by side is tests/test_cascade_attention.py's)."""
import pytest

from scripts import gpu_cascade_overlap as probe


def test_cases_are_whole_pages_in_whole_groups():
    # gpu_check_cascade.Batch stores a prefix in whole 16-token pages; a case's rows are whole groups.
    assert all(prefix % 16 == 0 and rows % group == 0 for rows, group, prefix, _ in probe.CASES)


def test_forms_start_from_the_passes_in_turn():
    """Every form's output is compared bit for bit with in_turn's, so in_turn is one of them,
    and each form names a stream arrangement the probe knows."""
    assert "in_turn" in probe.FORMS and len(set(probe.FORMS)) == len(probe.FORMS)
    for form in probe.FORMS:
        assert form in ("in_turn", "own_only") or form.removesuffix("_2st") in ("side_by_side", "swapped")


def test_unknown_form_is_refused(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["gpu_cascade_overlap.py", "--forms", "sideways", "--out", "x.json"])
    with pytest.raises(SystemExit):
        probe.main()
    assert "invalid choice: 'sideways'" in capsys.readouterr().err
