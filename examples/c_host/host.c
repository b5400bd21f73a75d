/* A C host that owns the GPU: it makes its own CUDA context, stream and one arena, embeds CPython and has
 * dsv4rt write a greedy reply using only that arena and stream. Free device memory is read before and after,
 * so the output shows what (if anything) the runtime took outside the arena. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#ifndef PYTHON_EXECUTABLE
#define PYTHON_EXECUTABLE "python3"
#endif

/* The driver API's few types and calls, declared here so the host builds without a CUDA toolkit. The _v2
 * names are the entry points cuda.h has mapped these calls to since CUDA 4; drivers keep them. */
typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef unsigned long long CUdeviceptr;
enum { CU_STREAM_NON_BLOCKING = 1, CUDA_SUCCESS = 0 };

static struct {
    CUresult (*Init)(unsigned);
    CUresult (*DeviceGet)(CUdevice *, int);
    CUresult (*DeviceGetName)(char *, int, CUdevice);
    CUresult (*CtxCreate)(CUcontext *, unsigned, CUdevice);
    CUresult (*CtxDestroy)(CUcontext);
    CUresult (*StreamCreate)(CUstream *, unsigned);
    CUresult (*StreamDestroy)(CUstream);
    CUresult (*MemAlloc)(CUdeviceptr *, size_t);
    CUresult (*MemFree)(CUdeviceptr);
    CUresult (*MemGetInfo)(size_t *, size_t *);
    CUresult (*GetErrorName)(CUresult, const char **);
} cu;

static const struct { const char *symbol; void **slot; } DRIVER_CALLS[] = {
    {"cuInit", (void **)&cu.Init},
    {"cuDeviceGet", (void **)&cu.DeviceGet},
    {"cuDeviceGetName", (void **)&cu.DeviceGetName},
    {"cuCtxCreate_v2", (void **)&cu.CtxCreate},
    {"cuCtxDestroy_v2", (void **)&cu.CtxDestroy},
    {"cuStreamCreate", (void **)&cu.StreamCreate},
    {"cuStreamDestroy_v2", (void **)&cu.StreamDestroy},
    {"cuMemAlloc_v2", (void **)&cu.MemAlloc},
    {"cuMemFree_v2", (void **)&cu.MemFree},
    {"cuMemGetInfo_v2", (void **)&cu.MemGetInfo},
    {"cuGetErrorName", (void **)&cu.GetErrorName},
};

/* Runs in the embedded interpreter: everything dsv4rt needs comes from the arguments. */
static const char REPLY_PY[] =
    "from dsv4rt.chat import encode_prompt_ids\n"
    "from dsv4rt.cuda.runtime import Runtime\n"
    "from dsv4rt.engine import Engine\n"
    "from dsv4rt.reference.sampling import SamplingParams\n"
    "\n"
    "def reply(model_dir, prompt, ptr, size, stream, max_new_tokens, kv_mib, dtype):\n"
    "    runtime = Runtime(arena_bytes=size, ptr=ptr, stream=stream)\n"
    "    engine = Engine(model_dir, 'cuda', runtime=runtime, kv_bytes=kv_mib << 20, max_running=1, dtype=dtype)\n"
    "    ids = encode_prompt_ids(engine.tokenizer, [{'role': 'user', 'content': prompt}])\n"
    "    (out,) = engine.generate([ids], SamplingParams(temperature=0, max_new_tokens=max_new_tokens))\n"
    "    return out.text, out.token_ids, runtime.arena.used\n";

static const char USAGE[] =
    "usage: host MODEL_DIR [--prompt TEXT] [--max-new-tokens N] [--arena-mib N] [--kv-mib N] "
    "[--dtype bf16|float32]\n";

#define MiB (1024.0 * 1024.0)

struct options {
    const char *model_dir, *prompt, *dtype;
    long max_new_tokens, arena_mib, kv_mib; /* arena_mib 0: 90% of free memory */
};

static int fail(const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    fputs("host: ", stderr);
    vfprintf(stderr, fmt, args);
    fputc('\n', stderr);
    va_end(args);
    return 1;
}

static int positive(const char *option, const char *text, long *out) {
    char *end;
    errno = 0;
    long v = strtol(text, &end, 10);
    if (errno || *end || end == text || v <= 0) {
        fail("%s must be a positive integer, got '%s'", option, text);
        return 0;
    }
    *out = v;
    return 1;
}

/* 0: parsed; 2: a usage error, reported. */
static int parse(int argc, char **argv, struct options *o) {
    static const char *const with_value[] = {"--prompt", "--dtype", "--max-new-tokens", "--arena-mib", "--kv-mib"};
    *o = (struct options){NULL, "Write a haiku about GPUs.", "bf16", 32, 0, 1024};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int known = 0;
        for (size_t k = 0; k < sizeof with_value / sizeof with_value[0]; k++) known |= !strcmp(a, with_value[k]);
        if (!known) {
            if (a[0] == '-' || o->model_dir) {
                fail("unexpected argument '%s'", a);
                fputs(USAGE, stderr);
                return 2;
            }
            o->model_dir = a;
            continue;
        }
        const char *value = argv[++i];
        if (!value) {
            fail("%s needs a value", a);
            return 2;
        }
        if (!strcmp(a, "--prompt")) o->prompt = value;
        else if (!strcmp(a, "--dtype")) o->dtype = value;
        else if (!positive(a, value, !strcmp(a, "--max-new-tokens") ? &o->max_new_tokens
                                     : !strcmp(a, "--arena-mib") ? &o->arena_mib : &o->kv_mib)) return 2;
    }
    if (!o->model_dir) {
        fputs(USAGE, stderr);
        return 2;
    }
    struct stat st;
    if (strcmp(o->dtype, "bf16") && strcmp(o->dtype, "float32"))
        fail("--dtype must be bf16 or float32, got '%s'", o->dtype);
    else if (stat(o->model_dir, &st) || !S_ISDIR(st.st_mode))
        fail("model directory '%s' does not exist", o->model_dir);
    else
        return 0;
    return 2;
}

static int load_driver(void) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!lib) return fail("cannot load the CUDA driver (%s): this host needs an NVIDIA GPU and its driver", dlerror());
    for (size_t i = 0; i < sizeof DRIVER_CALLS / sizeof DRIVER_CALLS[0]; i++)
        if (!(*DRIVER_CALLS[i].slot = dlsym(lib, DRIVER_CALLS[i].symbol)))
            return fail("the CUDA driver has no %s: it is older than this host needs", DRIVER_CALLS[i].symbol);
    return 0;
}

static int cuda_failed(CUresult r, const char *call) {
    const char *name = NULL;
    if (r == CUDA_SUCCESS) return 0;
    cu.GetErrorName(r, &name);
    return fail("%s failed: %s", call, name ? name : "unknown error");
}

/* The pending Python exception as one line: its type and the first line of its message. */
static int python_failed(void) {
#if PY_VERSION_HEX >= 0x030C0000
    PyObject *value = PyErr_GetRaisedException();
#else
    PyObject *type, *value, *trace;
    PyErr_Fetch(&type, &value, &trace);
    PyErr_NormalizeException(&type, &value, &trace);
    Py_XDECREF(type);
    Py_XDECREF(trace);
#endif
    PyObject *text = value ? PyObject_Str(value) : NULL;
    const char *message = text ? PyUnicode_AsUTF8(text) : NULL;
    char line[1024];
    snprintf(line, sizeof line, "%s", message ? message : "");
    line[strcspn(line, "\n")] = 0;
    fail("dsv4rt: %s: %s", value ? Py_TYPE(value)->tp_name : "error", line);
    PyErr_Clear();
    Py_XDECREF(text);
    Py_XDECREF(value);
    return 1;
}

static int start_python(void) {
    PyConfig config;
    PyConfig_InitPythonConfig(&config);
    /* The interpreter make was run with, so that its venv and site-packages are the ones found. */
    PyStatus status = PyConfig_SetBytesString(&config, &config.program_name, PYTHON_EXECUTABLE);
    if (!PyStatus_Exception(status)) status = Py_InitializeFromConfig(&config);
    PyConfig_Clear(&config);
    if (PyStatus_Exception(status))
        return fail("cannot start Python: %s", status.err_msg ? status.err_msg : "unknown error");
    return 0;
}

/* (text, token ids, arena bytes dsv4rt holds), or NULL with the error reported. */
static PyObject *generate(const struct options *o, CUdeviceptr arena, size_t arena_bytes, CUstream stream) {
    PyObject *globals = PyModule_GetDict(PyImport_AddModule("__main__"));
    PyObject *defined = PyRun_String(REPLY_PY, Py_file_input, globals, globals);
    if (!defined) return python_failed(), NULL;
    Py_DECREF(defined);
    PyObject *result = PyObject_CallFunction(PyDict_GetItemString(globals, "reply"), "ssKnKlls", o->model_dir,
                                             o->prompt, (unsigned long long)arena, (Py_ssize_t)arena_bytes,
                                             (unsigned long long)(uintptr_t)stream, o->max_new_tokens, o->kv_mib,
                                             o->dtype);
    return result ? result : (python_failed(), NULL);
}

/* The reply comes last: its text may hold newlines. */
static void print_reply(PyObject *result) {
    PyObject *ids = PyTuple_GetItem(result, 1);
    printf("dsv4rt's share of the arena: %.1f MiB\ntoken ids:", PyLong_AsDouble(PyTuple_GetItem(result, 2)) / MiB);
    for (Py_ssize_t i = 0; i < PyList_Size(ids); i++) printf(" %ld", PyLong_AsLong(PyList_GetItem(ids, i)));
    printf("\nreply:\n%s\n", PyUnicode_AsUTF8(PyTuple_GetItem(result, 0)));
}

int main(int argc, char **argv) {
    struct options o;
    int status = parse(argc, argv, &o);
    if (status) return status;
    if (load_driver()) return 1;

    CUdevice device;
    CUcontext context = NULL;
    CUstream stream = NULL;
    CUdeviceptr arena = 0;
    char name[256] = "";
    size_t before, after_arena, after_reply, total;
    status = 1;
    if (cuda_failed(cu.Init(0), "cuInit") || cuda_failed(cu.DeviceGet(&device, 0), "cuDeviceGet")
        || cuda_failed(cu.CtxCreate(&context, 0, device), "cuCtxCreate")
        || cuda_failed(cu.StreamCreate(&stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        || cuda_failed(cu.MemGetInfo(&before, &total), "cuMemGetInfo"))
        goto done;
    size_t arena_bytes = o.arena_mib ? (size_t)o.arena_mib << 20 : (size_t)(before * 0.9) >> 21 << 21;
    if (cuda_failed(cu.MemAlloc(&arena, arena_bytes), "cuMemAlloc of the arena")
        || cuda_failed(cu.MemGetInfo(&after_arena, &total), "cuMemGetInfo"))
        goto done;
    cu.DeviceGetName(name, sizeof name, device);
    printf("device: %s\narena: %.0f MiB at 0x%llx, stream %p\n", name, arena_bytes / MiB, arena, (void *)stream);
    fflush(stdout);

    if (start_python()) goto done;
    PyObject *result = generate(&o, arena, arena_bytes, stream);
    if (result && !cuda_failed(cu.MemGetInfo(&after_reply, &total), "cuMemGetInfo")) {
        printf("free device memory: %.0f MiB before the arena, %.0f MiB after it, %.0f MiB after the reply\n",
               before / MiB, after_arena / MiB, after_reply / MiB);
        printf("taken outside the arena while dsv4rt ran: %.0f MiB\n", ((double)after_arena - after_reply) / MiB);
        print_reply(result);
        status = 0;
    }
    Py_XDECREF(result);
    fflush(stdout);
    if (Py_FinalizeEx() < 0) status = 1;
done:
    if (arena) cu.MemFree(arena);
    if (stream) cu.StreamDestroy(stream);
    if (context) cu.CtxDestroy(context);
    return status;
}
