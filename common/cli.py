"""The `pdserve` command.

    pdserve serve [flags]      one colocated service (HTTP front end, scheduler, detokenizer)
    pdserve prefill [flags]    the prefill side of a PD pair (serve --disaggregation-mode prefill)
    pdserve decode [flags]     the decode side of a PD pair (serve --disaggregation-mode decode)
    pdserve prepare-model      convert the embedded SmolLM2-135M-Instruct once; print its folder
    pdserve router [flags]     the router: PD (--pd-disaggregation) or plain (--worker-urls)
"""

from __future__ import annotations

import argparse
import sys

from common.config import ConfigError, add_server_args, server_args_from_namespace


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run a colocated service (prefill and decode together)")
    add_server_args(serve)
    for mode in ("prefill", "decode"):
        side = sub.add_parser(mode, help=f"run the {mode} side of a PD deployment")
        add_server_args(side)
        side.set_defaults(disaggregation_mode=mode)
    sub.add_parser("prepare-model", help="prepare the embedded default model and print its path")
    from router.config import add_router_args

    add_router_args(sub.add_parser(
        "router", help="route requests to prefill/decode services (--pd-disaggregation) or to "
                       "colocated ones (--worker-urls)"))
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    if ns.command == "prepare-model":
        from common.model_store.default_model import ensure_default_model

        print(ensure_default_model())
        return 0
    if ns.command == "router":
        from router.config import router_args_from_namespace
        from router.launch import run_router

        try:
            router_args = router_args_from_namespace(ns)
        except ConfigError as exc:
            print(f"pdserve: error: {exc}", file=sys.stderr)
            return 2
        return run_router(router_args)
    if ns.command in ("prefill", "decode") and ns.disaggregation_mode != ns.command:
        print(f"pdserve: error: `pdserve {ns.command}` runs with --disaggregation-mode "
              f"{ns.command} (got {ns.disaggregation_mode})", file=sys.stderr)
        return 2
    try:
        args = server_args_from_namespace(ns)
    except ConfigError as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2
    from common.server.launch import serve

    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
