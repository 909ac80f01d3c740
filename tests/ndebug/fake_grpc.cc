// Stand-ins for libgrpc as built with and without NDEBUG: gRPC declares
// grpc_stream_ref_init with a trailing object type only without NDEBUG
// (src/core/lib/transport/transport.h), which is what
// cmake/GrpcNdebug.cmake reads from the library. FAKE_GRPC_NONE: a library
// without the symbol at all.
struct grpc_stream_refcount;
typedef void (*grpc_iomgr_cb_func)(void* arg, int error);

#if defined(FAKE_GRPC_DEBUG)
void grpc_stream_ref_init(grpc_stream_refcount*, int, grpc_iomgr_cb_func, void*, const char*) {}
#elif defined(FAKE_GRPC_NDEBUG)
void grpc_stream_ref_init(grpc_stream_refcount*, int, grpc_iomgr_cb_func, void*) {}
#else
void grpc_something_else() {}
#endif
