/* A program with an exported grpc_init of its own (OWN_GRPC_INIT), as a
 * program linked with its own copy of gRPC has, or without one: preloaded,
 * grpc-rdma must say that the first one's connections will not reach it,
 * and say nothing of the second. */
#ifdef OWN_GRPC_INIT
void grpc_init(void) {}
#endif
int main(void) { return 0; }
