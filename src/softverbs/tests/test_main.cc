// softverbs_test's main: either the gtest suite, or (with --scenario NAME)
// one child-process scenario that a test runs with its own environment.
#include <gtest/gtest.h>
#include <string.h>

#include <cstdlib>
#include <string>

int ScenarioCmConnectDie(uint16_t port);
int ScenarioRingStress(uint16_t port);
int ScenarioFailWr();
int ScenarioDrop();
int ScenarioDelay();
int ScenarioSmallQueues();
int ScenarioStats();
int ScenarioArmEvents();
int ScenarioExchange();
int ScenarioListDevices();
int ScenarioMemlock();
int ScenarioOdpOff();
int ScenarioDeviceCpu();
int ScenarioOneCopy(const char* mode);
int ScenarioOneCopyDereg();
int ScenarioOneCopyQpGone(bool destroy);
int ScenarioOneCopyRead(const char* mode);
int ScenarioOneCopyReadFlushed(bool destroy);

#if defined(__SANITIZE_ADDRESS__)
// ChannelTest.BlockedWaiterCanBeCancelled ends a thread with pthread_cancel;
// AddressSanitizer does not unpoison a stack unwound that way and then
// trips over its own alternate signal stack when the thread exits (a
// sanitizer false positive). Without that stack it is quiet.
extern "C" const char* __asan_default_options() { return "use_sigaltstack=0"; }
#endif

int main(int argc, char** argv) {
  if (argc >= 3 && strcmp(argv[1], "--scenario") == 0) {
    std::string s = argv[2];
    if (s == "cm-connect-die" && argc >= 4) return ScenarioCmConnectDie(std::atoi(argv[3]));
    if (s == "ring-stress" && argc >= 4) return ScenarioRingStress(std::atoi(argv[3]));
    if (s == "fail-wr") return ScenarioFailWr();
    if (s == "drop") return ScenarioDrop();
    if (s == "delay") return ScenarioDelay();
    if (s == "small-queues") return ScenarioSmallQueues();
    if (s == "stats") return ScenarioStats();
    if (s == "arm-events") return ScenarioArmEvents();
    if (s == "exchange") return ScenarioExchange();
    if (s == "list-devices") return ScenarioListDevices();
    if (s == "memlock") return ScenarioMemlock();
    if (s == "odp-off") return ScenarioOdpOff();
    if (s == "device-cpu") return ScenarioDeviceCpu();
    if (s == "one-copy" && argc >= 4)
      return strcmp(argv[3], "dereg") == 0     ? ScenarioOneCopyDereg()
             : strcmp(argv[3], "qp-gone") == 0  ? ScenarioOneCopyQpGone(true)
             : strcmp(argv[3], "qp-error") == 0 ? ScenarioOneCopyQpGone(false)
             : strcmp(argv[3], "read-flush-error") == 0   ? ScenarioOneCopyReadFlushed(false)
             : strcmp(argv[3], "read-flush-destroy") == 0 ? ScenarioOneCopyReadFlushed(true)
             : strncmp(argv[3], "read", 4) == 0 ? ScenarioOneCopyRead(argv[3])
                                               : ScenarioOneCopy(argv[3]);
    fprintf(stderr, "unknown scenario %s\n", s.c_str());
    return 100;
  }
  ::testing::InitGoogleTest(&argc, argv);
  for (int i = 1; i < argc; ++i) {
    // Before any verbs call: softverbs reads its environment once.
    if (strcmp(argv[i], "--softverbs-shm=0") == 0) setenv("SOFTVERBS_SHM", "0", 1);
    if (strcmp(argv[i], "--softverbs-acceptor-doorbell=0") == 0)
      setenv("SOFTVERBS_ACCEPTOR_DOORBELL", "0", 1);
  }
  return RUN_ALL_TESTS();
}
