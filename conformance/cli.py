"""`kvgate conformance`: run the ported Inference Extension conformance suite against a cluster."""

from __future__ import annotations

import argparse
import logging
import sys


def add_conformance_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("conformance", help="run the Gateway API Inference Extension conformance suite",
                       description="Apply the upstream conformance manifests to the cluster of --kubeconfig (or "
                                   "$KUBECONFIG / in-cluster), run the tests against the Gateway implementation "
                                   "of --gateway-class and write a ConformanceReport. The Gateway API and "
                                   "InferencePool CRDs must be installed.")
    p.add_argument("--gateway-class", help="GatewayClass of the implementation under test (required to run)")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: $KUBECONFIG, else in-cluster)")
    p.add_argument("--epp-image", default=None,
                   help="run this image's `kvgate epp` in place of upstream's test EPP (lwepp) in the manifests")
    p.add_argument("--report-output", default=None, help="write the ConformanceReport YAML here")
    p.add_argument("--run-test", action="append", default=[], metavar="NAME", help="run only this test (repeatable)")
    p.add_argument("--skip-tests", default="", metavar="A,B", help="comma-separated tests to skip")
    p.add_argument("--supported-features", default="", metavar="A,B",
                   help="features the implementation supports (default: all); tests needing others are skipped")
    p.add_argument("--cleanup-base-resources", default=True, action=argparse.BooleanOptionalAction,
                   help="delete base.yaml's objects at the end (default: yes)")
    p.add_argument("--timeout-scale", type=float, default=1.0, help="multiply every wait by this factor")
    p.add_argument("--implementation-organization", default="kvgate")
    p.add_argument("--implementation-project", default="kvgate")
    p.add_argument("--implementation-version", default=None)
    p.add_argument("--list", action="store_true", help="list the tests and exit")
    p.set_defaults(func=run_conformance)
    return p


def run_conformance(args: argparse.Namespace) -> int:
    from kvgate import __version__
    from kvgate.conformance.cluster import Cluster
    from kvgate.conformance.suite import Options, Result, report, run, selected, write_report
    from kvgate.conformance.timing import Timing

    logging.getLogger("kvgate.conformance").setLevel(logging.INFO)
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(asctime)s %(message)s", level=logging.WARNING)
    split = lambda s: tuple(x.strip() for x in s.split(",") if x.strip())  # noqa: E731
    options = Options(gateway_class=args.gateway_class, epp_image=args.epp_image, run_tests=tuple(args.run_test),
                      skip_tests=split(args.skip_tests), supported_features=split(args.supported_features),
                      cleanup_base_resources=args.cleanup_base_resources,
                      implementation={"organization": args.implementation_organization,
                                      "project": args.implementation_project,
                                      "version": args.implementation_version or __version__,
                                      "url": "https://github.com/kvgate/kvgate", "contact": []},
                      timing=Timing().scaled(args.timeout_scale))
    try:
        plan = selected(options)
    except ValueError as exc:
        raise SystemExit(f"kvgate conformance: {exc}") from exc
    if args.list:
        for test, why in plan:
            print(f"{test.short_name:48s} {why or test.description}")
        return 0
    if not args.gateway_class:
        raise SystemExit("kvgate conformance: --gateway-class is required")
    cluster = Cluster.connect(args.gateway_class, args.epp_image, args.kubeconfig)
    print(f"conformance: {sum(why is None for _, why in plan)} of {len(plan)} tests against gateway class "
          f"{args.gateway_class!r} on Kubernetes {cluster.server_version}", flush=True)

    def show(r: Result) -> None:
        line = f"{r.outcome.upper():7s} {r.name} ({r.seconds:.1f}s)"
        print(line + (f": {r.message.splitlines()[0]}" if r.message and r.outcome != "Passed" else ""), flush=True)

    results = run(cluster, options, on_result=show)
    data = report(results, options, cluster.server_version)
    if args.report_output:
        write_report(args.report_output, data)
        print(f"report: {args.report_output}")
    counts = data["profiles"][0]["core"]["statistics"]
    print(f"{counts['Passed']} passed, {counts['Failed']} failed, {counts['Skipped']} skipped")
    return 1 if counts["Failed"] else 0


if __name__ == "__main__":
    sys.exit(run_conformance(add_conformance_parser(argparse.ArgumentParser().add_subparsers()).parse_args()))
