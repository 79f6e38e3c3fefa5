"""Test instrumentation for the chaos soak (tests/end_to_end/test_chaos_soak.py), on the PYTHONPATH of the processes
it starts: every data-loader worker waits `VIT_MPP_TEST_WORKER_START_S` seconds between torch's own start of the
worker (its signal handlers set) and the worker's init function, as a worker on a loaded machine does. A signal that
lands in that window once killed the worker, and the run with it; the soak must find that on code that has the
fault, and the window widened makes it likely."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import time

DELAY_S = float(os.environ.get("VIT_MPP_TEST_WORKER_START_S", "0"))
WORKER_MODULE = "torch.utils.data._utils.worker"


class _Patch(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Wraps `_worker_loop`'s init function once torch's worker module is imported."""

    def find_spec(self, name, path, target=None):
        if name != WORKER_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        real = spec.loader

        class Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return real.create_module(spec)

            def exec_module(self, module):
                real.exec_module(module)
                loop = module._worker_loop

                def slow_loop(*args, **kwargs):
                    # _worker_loop(kind, dataset, index_queue, data_queue, done, auto_collation, collate_fn,
                    # drop_last, base_seed, init_fn, ...): init_fn is the 10th
                    init = args[9]

                    def delayed(worker_id, init=init):
                        time.sleep(DELAY_S)
                        if init is not None:
                            init(worker_id)

                    args = (*args[:9], delayed, *args[10:])
                    return loop(*args, **kwargs)

                module._worker_loop = slow_loop

        spec.loader = Loader()
        return spec


if DELAY_S > 0:
    sys.meta_path.insert(0, _Patch())
