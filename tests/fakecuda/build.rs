//! The shared library's SONAME is `libcuda.so.1`, the NVIDIA driver's: a process that loaded
//! the fake (by any path) has "libcuda.so.1" loaded, as with the real driver, so that code
//! asking for it with `RTLD_NOLOAD` (cistern's backend, as PyTorch's) finds the one in use.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcuda.so.1");
}
