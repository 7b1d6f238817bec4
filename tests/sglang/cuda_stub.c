/* A stand-in for the CUDA driver library (libcuda.so.1) on a machine without a GPU.
 *
 * SGLang imports sgl_kernel even with --device cpu, and the only PyPI build of it links the
 * driver library. These are the driver entry points its shared objects link (`nm -D
 * --undefined-only` on sgl_kernel's .so files lists them); each answers CUDA_ERROR_NO_DEVICE.
 * Nothing on SGLang's CPU path calls them: they only have to resolve.
 */

#include <stddef.h>

#define CUDA_ERROR_NO_DEVICE 100

typedef int CUresult;

static const char no_device[] = "CUDA_ERROR_NO_DEVICE: no CUDA-capable device (stand-in libcuda)";

#define NO_DEVICE(name) \
    CUresult name(void) { return CUDA_ERROR_NO_DEVICE; }

CUresult cuGetErrorString(CUresult error, const char **message) {
    (void)error;
    if (message != NULL) *message = no_device;
    return 0;
}

CUresult cuDriverGetVersion(int *version) {
    if (version != NULL) *version = 0;
    return CUDA_ERROR_NO_DEVICE;
}

NO_DEVICE(cuCtxFromGreenCtx)
NO_DEVICE(cuCtxPopCurrent_v2)
NO_DEVICE(cuCtxPushCurrent_v2)
NO_DEVICE(cuDevResourceGenerateDesc)
NO_DEVICE(cuDevSmResourceSplitByCount)
NO_DEVICE(cuDeviceGetDevResource)
NO_DEVICE(cuGetProcAddress_v2)
NO_DEVICE(cuGreenCtxCreate)
NO_DEVICE(cuGreenCtxDestroy)
NO_DEVICE(cuGreenCtxGetDevResource)
NO_DEVICE(cuPointerGetAttribute)
NO_DEVICE(cuStreamCreate)
