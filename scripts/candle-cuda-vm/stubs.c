/* Stand-ins for the CUDA libraries candle-core's `cuda` feature links (cuBLAS, cuBLASLt, cuRAND,
 * NVRTC, the CUDA runtime), for running memattn-candle's CUDA path on the VM-backed driver
 * (vm-cuda) in tests: creating and destroying a handle, and binding it to a stream, succeed, so
 * that `candle_core::Device::new_cuda` works; every other function (listed by
 * scripts/candle-cuda-vm.sh from the linker's undefined symbols) fails with a non-zero status.
 * No math is done here: a test that reaches cuBLAS or cuRAND fails loudly. */
#include <stdint.h>
#include <stdlib.h>

static int handles;

int cublasCreate_v2(void **handle) { *handle = &handles; return 0; }
int cublasDestroy_v2(void *handle) { (void)handle; return 0; }
int cublasSetStream_v2(void *handle, void *stream) { (void)handle; (void)stream; return 0; }
int cublasLtCreate(void **handle) { *handle = &handles; return 0; }
int cublasLtDestroy(void *handle) { (void)handle; return 0; }
int curandCreateGenerator(void **gen, int kind) { (void)kind; *gen = &handles; return 0; }
int curandDestroyGenerator(void *gen) { (void)gen; return 0; }
int curandSetStream(void *gen, void *stream) { (void)gen; (void)stream; return 0; }
int curandSetPseudoRandomGeneratorSeed(void *gen, unsigned long long seed) { (void)gen; (void)seed; return 0; }
