"""Turns off llama.cpp's repacked weight layouts in llama-cpp-python (imported for its side effect).

llama.cpp's CPU backend repacks Q4_0/Q4_K/IQ4_NL weights into interleaved layouts ("CPU_REPACK" extra
buffer) whose GEMV/GEMM kernels round differently from its per-row vec_dot kernels, and whether it does so
depends on the CPU. reckon reproduces the per-row kernels bit for bit (tests/fixtures/parity/README.md), so
the parity scripts run llama.cpp with use_extra_bufts = false."""
import llama_cpp

_default_model_params = llama_cpp.llama_model_default_params


def _model_params_without_repack():
    params = _default_model_params()
    params.use_extra_bufts = False
    return params


llama_cpp.llama_model_default_params = _model_params_without_repack
llama_cpp.llama.llama_cpp.llama_model_default_params = _model_params_without_repack
