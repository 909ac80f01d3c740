#!/usr/bin/python3
"""rdma-core's own test suite (pyverbs, Debian's python3-pyverbs) over softverbs.

usage: pyverbs_runner.py [--two-hosts NETNS_PATH ADDR] TESTS_DIR

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

--two-hosts runs only the RDMA CM tests (test_rdmacm), with their two players
on two hosts: the passive one stays in this process's network namespace and
on the address the suite found for the device; the active one enters the
network namespace NETNS_PATH (a file such as /run/netns/NAME) and binds ADDR,
which must be the address of a second softverbs device. rdma-core's suite
runs both players on one address (the active binds the address it connects
to); that one line is all this mode changes, and the active player checks
that it really is on another host (the passive address is not local there).
"""
import collections
import ctypes
import errno
import os
import socket
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
    # On-demand paging for what softverbs does not do at all (atomics, UD).
    r"ODP is unavailable - Operation not supported on this device",
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


CLONE_NEWNET = 0x40000000


def enter_netns(path):
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"setns({path}): {os.strerror(e)}")
    finally:
        os.close(fd)


def is_local(addr):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((addr, 0))
        return True
    except OSError as e:
        if e.errno == errno.EADDRNOTAVAIL:
            return False
        raise
    finally:
        s.close()


def two_hosts(netns_path, active_addr):
    """Runs each RDMA CM test's active player in another network namespace."""
    import tests.base as base
    import tests.base_rdmacm as base_rdmacm
    two_nodes = base.RDMACMBaseTest.two_nodes_rdmacm_traffic

    def two_nodes_on_two_hosts(self, connection_resources, test_flow, *args, **kwargs):
        passive_addr = self.ip_addr

        def flow(**flow_kwargs):
            # In the forked player, before it touches a device.
            if not flow_kwargs.get("passive"):
                enter_netns(netns_path)
                if is_local(passive_addr) or not is_local(active_addr):
                    print(f"Player active: not on a second host ({passive_addr} local: "
                          f"{is_local(passive_addr)}, {active_addr} local: "
                          f"{is_local(active_addr)})")
                    sys.exit(2)
                addr_info = base_rdmacm.AddrInfo

                def own_source(*ai_args, **ai_kwargs):
                    if ai_kwargs.get("src") == passive_addr and "dst" in ai_kwargs:
                        ai_kwargs["src"] = active_addr
                    return addr_info(*ai_args, **ai_kwargs)
                base_rdmacm.AddrInfo = own_source
            return test_flow(**flow_kwargs)
        return two_nodes(self, connection_resources, flow, *args, **kwargs)
    base.RDMACMBaseTest.two_nodes_rdmacm_traffic = two_nodes_on_two_hosts


def flatten(suite):
    for t in suite:
        if isinstance(t, unittest.TestSuite):
            yield from flatten(t)
        else:
            yield t


def main():
    usage = "usage: pyverbs_runner.py [--two-hosts NETNS_PATH ADDR] TESTS_DIR"
    argv = sys.argv[1:]
    hosts = None
    if argv[:1] == ["--two-hosts"]:
        if len(argv) != 4:
            sys.exit(usage)
        hosts = (argv[1], argv[2])
        argv = argv[3:]
    if len(argv) != 1:
        sys.exit(usage)
    tests_dir = os.path.abspath(argv[0])
    sys.path.insert(0, tests_dir)  # args_parser, as run_tests.py finds it
    from args_parser import parser
    sys.argv = [sys.argv[0]]
    parser.parse_args()
    tests = SourceFileLoader("tests", os.path.join(tests_dir, "__init__.py")).load_module()
    all_tests = list(flatten(unittest.defaultTestLoader.loadTestsFromModule(tests)))
    must_pass = MUST_PASS
    if hosts:
        two_hosts(*hosts)
        all_tests = [t for t in all_tests if t.id().startswith("tests.test_rdmacm.")]
        must_pass = [n for n in MUST_PASS if n.startswith("tests.test_rdmacm.")]
    left_out = {n: why for n, why in LEFT_OUT.items() if any(t.id() == n for t in all_tests)}
    run = unittest.TestSuite(t for t in all_tests if t.id() not in left_out)
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
    for name in must_pass:
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
    for name, why in left_out.items():
        print(f"left out: {name}: {why}")
    for p in problems:
        print(f"PROBLEM: {p}")
    print(f"pyverbs: {result.testsRun} run, {passed} passed, {len(skipped)} skipped, "
          f"{len(result.failures)} failed, {len(result.errors)} errors, "
          f"{len(left_out)} left out, {len(problems)} other problems")
    ok = not result.failures and not result.errors and not problems
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
