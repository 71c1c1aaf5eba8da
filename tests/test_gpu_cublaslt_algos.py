"""scripts/gpu_cublaslt_algos.py's arithmetic: the operands it hands cuBLASLt, the heuristic
result's layout, its summary line (the timing itself needs a GPU)."""
import ctypes

import numpy as np

from scripts.gpu_cublaslt_algos import CUBLAS_OP_T, HeuristicResult, gemm_operands, summary_line


def column_major(buf: np.ndarray, rows: int, cols: int, ld: int) -> np.ndarray:
    """The rows x cols matrix cuBLAS reads from a flat buffer with leading dimension ld."""
    return np.stack([buf[j * ld: j * ld + rows] for j in range(cols)], axis=1)


def test_operands_compute_f_linear():
    rows, n, k = 3, 5, 4
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((rows, k)), rng.standard_normal((n, k))
    ops = gemm_operands(rows, n, k)
    assert ops["transa"] == CUBLAS_OP_T
    a = column_major(w.reshape(-1), *ops["a"])          # torch's row-major buffers, as cuBLAS sees them
    b = column_major(x.reshape(-1), *ops["b"])
    c = a.T @ b                                         # op_T(A) @ B
    r, cols, ld = ops["c"]
    assert c.shape == (r, cols) and ld == r
    out = c.T.reshape(-1).reshape(rows, n)              # written column-major with ld n: out row-major
    np.testing.assert_allclose(out, x @ w.T)


def test_heuristic_result_is_cublaslt_layout():
    # cublasLtMatmulHeuristicResult_t: algo (8 x uint64), size_t, status, float, int[4].
    assert ctypes.sizeof(HeuristicResult) == 96


def test_summary_line_names_base_first_pick_and_best():
    case = {"rows": 256, "proj": "o_proj", "error": None,
            "algos": [{"algo": "F.linear", "us": 16.0}, {"algo": 0, "us": 16.2}, {"algo": 1, "skipped": "x"},
                      {"algo": 2, "us": 12.8}]}
    line = summary_line(case)
    assert "F.linear    16.0 us" in line and "heuristic #0    16.2" in line
    assert "best #2    12.8 (1.250x)" in line and "2 timed of 3" in line
    assert "no result (timed out" in summary_line({**case, "algos": None, "error": "timed out after 90 s"})
