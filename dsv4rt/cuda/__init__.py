from .build import KernelBuildError, Module, build_all, compile_module, device_arch, ptxas_report
