//! Without a driver, opening a GPU is a clear `NoDevice` error, never a panic.

use kairos_cuda::CudaGpu;
use kairos_gpu::GpuError;

#[test]
fn missing_driver_is_no_device() {
    if kairos_cuda::driver::is_present() {
        eprintln!("note: libcuda is present here; the missing-driver path is not exercised");
        return;
    }
    match CudaGpu::new(0) {
        Err(GpuError::NoDevice(msg)) => assert!(msg.contains("driver"), "unhelpful message: {msg}"),
        Err(e) => panic!("expected NoDevice, got {e}"),
        Ok(_) => panic!("opened a GPU without a driver"),
    }
}
