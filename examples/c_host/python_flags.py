"""What `python3-config --includes` and `--embed --ldflags` print, from this interpreter's sysconfig: for a
venv or an install that has no python3-config."""
import os
import sys
import sysconfig

var = sysconfig.get_config_var
if sys.argv[1:] == ["--includes"]:
    print(f"-I{sysconfig.get_path('include')} -I{sysconfig.get_path('platinclude')}")
elif sys.argv[1:] == ["--ldflags"]:
    libdir = var("LIBDIR") if var("Py_ENABLE_SHARED") else var("LIBPL")  # LIBPL holds the static libpython
    if not os.path.isdir(libdir):  # an install moved after it was built keeps its build-time paths here
        libdir = os.path.join(sys.base_prefix, "lib")
    print(f"-L{libdir} -Wl,-rpath,{libdir} -lpython{var('LDVERSION')} {var('LIBS') or ''} {var('SYSLIBS') or ''}")
else:
    sys.exit("usage: python_flags.py --includes | --ldflags")
