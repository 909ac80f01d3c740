#!/usr/bin/python3
"""rdma-core's own test suite (pyverbs, Debian's python3-pyverbs) over softverbs.

usage: pyverbs_runner.py TESTS_DIR

TESTS_DIR is an unpacked copy of /usr/share/doc/rdma-core/tests. Runs every
test, as rdma-core's run_tests.py does, except the ones listed in LEFT_OUT
(each with the reason), then judges the result:

- no failure and no error;
- every skip for a reason in SKIPS_ALLOWED: rdma-core's own "not supported"
  answers for what softverbs does not emulate (docs/softverbs.md), or for
  other vendors' hardware. A skip for any other reason (no device, no
  address for the CM tests, a port down) means the run proved nothing;
- every test in MUST_PASS passed: a run in which softverbs did not load
  would skip them all.

Prints unittest's report, then one summary line; exit status 0 iff all of
the above hold.
"""
import collections
import os
import re
import sys
import unittest
from importlib.machinery import SourceFileLoader

LEFT_OUT = {
    "tests.test_rdmacm.CMTestCase.test_rdmacm_async_udp_traffic":
        "UD through RDMA CM (RDMA_PS_UDP) is not emulated, and the test has no "
        "not-supported path: rdma_create_id's EOPNOTSUPP surfaces as an error",
}

SKIPS_ALLOWED = [
    r"Can not run the test over non (MLX5|EFA) device",
    r"Could not open mlx5 context \(This is not an MLX5 device\)",
    r"Extended QP is not supported on this device",
    r"Create (RC|UC|UD) QP (with|without) (extended )?attrs is not supported",
    r"Create QP type \d+ is not supported",
    r"Create (Extended CQ|MW|XRCD|SRQ|AH) is not supported",
    r"Extended CQ is not supported",
    r"Create memory window of type \d+ is not supported",
    r"Device memory is not supported",
    r"ODP is not supported - No ODP caps",
    r"Allocating dmabuf is not supported by .*",
    r"Atomic operations are not supported",
    r"Parent Domain is not supported on this device",
    r"Query device real time is not supported",
    r"Importing a device is not supported",
    r"Multicast is not supported on this device",
    r"All gid indices populated, cannot check bad flow",
    # RoCE-only and root-on-Ethernet tests: softverbs ports are InfiniBand.
    r"Link layer of port=\d+ is InfiniBand , skip RoCE test",
    r"Must be run by root on Ethernet link layer",
    r"To Create RAW QP must be done by root on Ethernet link layer",
    # mlx5 tests that look for a RoCE v2 GID before their own vendor check.
    r"No supported port is up, can't run traffic",
    # Needs of the host, not of the device.
    r"There are no huge pages of size \w+ allocated",
    r"cuda-python [\d.]+\+ must be installed to run CUDA tests",
    r"PCI device must be passed by the user",
]

MUST_PASS = [
    "tests.test_device.DeviceTest.test_query_device",
    "tests.test_cq.CQAPITest.test_create_cq",
    "tests.test_cq_events.CqEventsTestCase.test_cq_events_rc",
    "tests.test_cqex.CqExTestCase.test_rc_traffic_cq_ex",
    "tests.test_qpex.QpExTestCase.test_qp_ex_rc_send_imm",
    "tests.test_qpex.QpExTestCase.test_qp_ex_rc_rdma_write_imm",
    "tests.test_qpex.QpExTestCase.test_qp_ex_rc_rdma_read",
    "tests.test_mr.MRTest.test_mr_rereg_pd",
    "tests.test_mr.MRTest.test_mr_rereg_addr",
    "tests.test_relaxed_ordering.RoTestCase.test_ro_rc_traffic",
    "tests.test_rdmacm.CMTestCase.test_rdmacm_async_traffic",
    "tests.test_rdmacm.CMTestCase.test_rdmacm_sync_traffic",
    "tests.test_rdmacm.CMTestCase.test_rdmacm_async_read",
]


def flatten(suite):
    for t in suite:
        if isinstance(t, unittest.TestSuite):
            yield from flatten(t)
        else:
            yield t


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: pyverbs_runner.py TESTS_DIR")
    tests_dir = os.path.abspath(sys.argv[1])
    sys.path.insert(0, tests_dir)  # args_parser, as run_tests.py finds it
    from args_parser import parser
    sys.argv = [sys.argv[0]]
    parser.parse_args()
    tests = SourceFileLoader("tests", os.path.join(tests_dir, "__init__.py")).load_module()
    all_tests = list(flatten(unittest.defaultTestLoader.loadTestsFromModule(tests)))
    run = unittest.TestSuite(t for t in all_tests if t.id() not in LEFT_OUT)
    ran = {t.id() for t in run}  # before running: the suite drops its tests as they finish
    result = unittest.TextTestRunner(verbosity=2, stream=sys.stdout).run(run)

    problems = []
    reasons = collections.Counter()
    for test, reason in result.skipped:
        reasons[reason] += 1
        if not any(re.fullmatch(p, reason) for p in SKIPS_ALLOWED):
            problems.append(f"{test.id()} skipped for a reason not allowed: {reason!r}")
    bad = {t.id() for t, _ in result.failures + result.errors}
    skipped = {t.id() for t, _ in result.skipped}
    for name in MUST_PASS:
        if name not in ran:
            problems.append(f"{name}: not in the suite (renamed?)")
        elif name in bad or name in skipped:
            problems.append(f"{name}: must pass, did not")
    passed = result.testsRun - len(bad) - len(skipped)
    by_module = collections.defaultdict(collections.Counter)
    for name in ran:
        module = name.split(".")[1]
        outcome = ("failed" if name in bad else "skipped" if name in skipped else "passed")
        by_module[module][outcome] += 1
    print("by module (passed/skipped/failed):")
    for module in sorted(by_module):
        c = by_module[module]
        print(f"  {module:32s} {c['passed']:3d} {c['skipped']:3d} {c['failed']:3d}")
    print("skip reasons:")
    for reason, n in reasons.most_common():
        print(f"  {n:4d}  {reason}")
    for name, why in LEFT_OUT.items():
        print(f"left out: {name}: {why}")
    for p in problems:
        print(f"PROBLEM: {p}")
    print(f"pyverbs: {result.testsRun} run, {passed} passed, {len(skipped)} skipped, "
          f"{len(result.failures)} failed, {len(result.errors)} errors, "
          f"{len(LEFT_OUT)} left out, {len(problems)} other problems")
    ok = not result.failures and not result.errors and not problems
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
