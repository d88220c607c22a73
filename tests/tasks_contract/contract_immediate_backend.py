# ruff: noqa: B018, SIM117 - Django's own test code, kept as written where it holds
"""Django 6.1.3's tests/tasks/test_immediate_backend.py, adapted to ``JobsBackend``.

The original (BSD-3-Clause, the Django Software Foundation; its licence text is in
``LICENSE.django`` beside this file) expects a finished result
from ``enqueue()``; here a qcluster on PostgreSQL runs the task, and the test waits for
it (``wait``). Its ``django.tasks`` log lines come from the worker process: they are read
from the log file this process and the worker share. Each change is marked
``# adapted:``; refusals are skipped.
"""

import unittest

from asgiref.sync import sync_to_async
from django.db import transaction
from django.tasks import TaskResultStatus, default_task_backend, task_backends
from django.tasks.exceptions import InvalidTask
from django.test import override_settings
from django.utils import timezone

from jobs.backends import JobsBackend

from . import tasks as test_tasks
from .support import WorkerTestCase, wait, worker_log

JOBS = {"BACKEND": "jobs.backends.JobsBackend", "QUEUES": [], "OPTIONS": {"MAX_ATTEMPTS": 1}}


@override_settings(TASKS={"default": JOBS})
class ImmediateBackendTestCase(WorkerTestCase):
    def test_using_correct_backend(self):
        self.assertEqual(default_task_backend, task_backends["default"])
        self.assertIsInstance(task_backends["default"], JobsBackend)  # adapted
        self.assertEqual(default_task_backend.alias, "default")
        self.assertEqual(default_task_backend.options, {"MAX_ATTEMPTS": 1})  # adapted

    def test_enqueue_task(self):
        for task in [test_tasks.noop_task, test_tasks.noop_task_async]:
            with self.subTest(task):
                result = wait(task.enqueue(1, two=3))  # adapted: a worker runs it

                self.assertEqual(result.status, TaskResultStatus.SUCCESSFUL)
                self.assertIs(result.is_finished, True)
                self.assertIsNotNone(result.started_at)
                self.assertIsNotNone(result.last_attempted_at)
                self.assertIsNotNone(result.finished_at)
                self.assertGreaterEqual(result.started_at, result.enqueued_at)
                self.assertGreaterEqual(result.finished_at, result.started_at)
                self.assertIsNone(result.return_value)
                self.assertEqual(result.task, task)
                self.assertEqual(result.args, [1])
                self.assertEqual(result.kwargs, {"two": 3})
                self.assertEqual(result.attempts, 1)

    async def test_enqueue_task_async(self):
        for task in [test_tasks.noop_task, test_tasks.noop_task_async]:
            with self.subTest(task):
                result = await task.aenqueue()
                await sync_to_async(wait)(result)  # adapted: a worker runs it

                self.assertEqual(result.status, TaskResultStatus.SUCCESSFUL)
                self.assertIs(result.is_finished, True)
                self.assertIsNotNone(result.started_at)
                self.assertIsNotNone(result.last_attempted_at)
                self.assertIsNotNone(result.finished_at)
                self.assertGreaterEqual(result.started_at, result.enqueued_at)
                self.assertGreaterEqual(result.finished_at, result.started_at)
                self.assertIsNone(result.return_value)
                self.assertEqual(result.task, task)
                self.assertEqual(result.args, [])
                self.assertEqual(result.kwargs, {})
                self.assertEqual(result.attempts, 1)

    def test_catches_exception(self):
        test_data = [
            (
                test_tasks.failing_task_value_error,  # Task function.
                ValueError,  # Expected exception.
                "This Task failed due to ValueError",  # Expected message.
            ),
            (
                test_tasks.failing_task_system_exit,
                SystemExit,
                "This Task failed due to SystemExit",
            ),
        ]
        for task, exception, message in test_data:
            with self.subTest(task):
                result = wait(task.enqueue())  # adapted: a worker runs it

                # adapted: the worker logs one ERROR line for the failure, by class and
                # frames: logs never carry exception messages (docs/app/tasks.md).
                failed = [line for line in worker_log(result.id, 3) if "state=FAILED" in line]
                self.assertEqual(len(failed), 1)
                self.assertTrue(failed[0].startswith("ERROR:django.tasks:"))
                self.assertNotIn(message, failed[0])

                self.assertEqual(result.status, TaskResultStatus.FAILED)
                with self.assertRaisesMessage(ValueError, "Task failed"):
                    result.return_value
                self.assertIs(result.is_finished, True)
                self.assertIsNotNone(result.started_at)
                self.assertIsNotNone(result.last_attempted_at)
                self.assertIsNotNone(result.finished_at)
                self.assertGreaterEqual(result.started_at, result.enqueued_at)
                self.assertGreaterEqual(result.finished_at, result.started_at)
                self.assertEqual(result.errors[0].exception_class, exception)
                traceback = result.errors[0].traceback
                self.assertIs(
                    traceback and traceback.endswith(f"{exception.__name__}: {message}\n"),
                    True,
                    traceback,
                )
                self.assertEqual(result.task, task)
                self.assertEqual(result.args, [])
                self.assertEqual(result.kwargs, {})

    @unittest.skip(
        "refused: KeyboardInterrupt is how a signal stops a worker; the process that enqueued "
        "never sees it: the lease of the job expires and it is retried, as after a crash"
    )
    def test_throws_keyboard_interrupt(self):
        pass

    def test_complex_exception(self):
        result = wait(test_tasks.complex_exception.enqueue())  # adapted: a worker runs it

        self.assertEqual(result.status, TaskResultStatus.FAILED)
        with self.assertRaisesMessage(ValueError, "Task failed"):
            result.return_value
        self.assertIsNotNone(result.started_at)
        self.assertIsNotNone(result.last_attempted_at)
        self.assertIsNotNone(result.finished_at)
        self.assertGreaterEqual(result.started_at, result.enqueued_at)
        self.assertGreaterEqual(result.finished_at, result.started_at)

        self.assertIsNone(result._return_value)
        self.assertEqual(result.errors[0].exception_class, ValueError)
        self.assertIn('ValueError(ValueError("This task failed"))', result.errors[0].traceback)

        self.assertEqual(result.task, test_tasks.complex_exception)
        self.assertEqual(result.args, [])
        self.assertEqual(result.kwargs, {})

    def test_complex_return_value(self):
        result = wait(test_tasks.complex_return_value.enqueue())  # adapted

        self.assertEqual(result.status, TaskResultStatus.FAILED)
        self.assertIsNotNone(result.started_at)
        self.assertIsNotNone(result.last_attempted_at)
        self.assertIsNotNone(result.finished_at)
        self.assertGreaterEqual(result.started_at, result.enqueued_at)
        self.assertGreaterEqual(result.finished_at, result.started_at)
        self.assertIsNone(result._return_value)
        self.assertEqual(result.errors[0].exception_class, TypeError)
        self.assertIn("Unsupported type", result.errors[0].traceback)

    def test_result(self):
        result = wait(default_task_backend.enqueue(test_tasks.calculate_meaning_of_life, [], {}))

        self.assertEqual(result.status, TaskResultStatus.SUCCESSFUL)
        self.assertEqual(result.return_value, 42)

    async def test_result_async(self):
        result = await default_task_backend.aenqueue(test_tasks.calculate_meaning_of_life, [], {})
        await sync_to_async(wait)(result)  # adapted

        self.assertEqual(result.status, TaskResultStatus.SUCCESSFUL)
        self.assertEqual(result.return_value, 42)

    async def test_can_get_result(self):
        # adapted from test_cannot_get_result: JobsBackend supports_get_result.
        result = await default_task_backend.aenqueue(test_tasks.calculate_meaning_of_life, [], {})
        again = await default_task_backend.aget_result(result.id)
        self.assertEqual(again.id, result.id)

    async def test_can_refresh_result(self):
        # adapted from test_cannot_refresh_result: results refresh from the database.
        result = await default_task_backend.aenqueue(test_tasks.calculate_meaning_of_life, (), {})
        await sync_to_async(wait)(result)
        await result.arefresh()
        self.assertEqual(result.return_value, 42)

    def test_can_pass_run_after(self):
        # adapted from test_cannot_pass_run_after: JobsBackend supports_defer.
        later = test_tasks.failing_task_value_error.using(run_after=timezone.now())
        default_task_backend.validate_task(later)
        soon = wait(test_tasks.calculate_meaning_of_life.using(run_after=timezone.now()).enqueue())
        self.assertEqual(soon.return_value, 42)

    def test_enqueue_logs(self):
        # adapted: the lines come from two processes into one file (support.worker_log):
        # "enqueued" from this one, RUNNING and SUCCESSFUL from the worker.
        result = wait(test_tasks.noop_task.enqueue())
        captured_logs = worker_log(result.id, 3)

        self.assertEqual(len(captured_logs), 3)

        enqueued = [line for line in captured_logs if "enqueued" in line]
        self.assertEqual(len(enqueued), 1)
        self.assertIn(result.id, enqueued[0])
        captured_logs.remove(enqueued[0])  # adapted: the worker may log before this process

        self.assertIn("state=RUNNING", captured_logs[0])
        self.assertIn(result.id, captured_logs[0])

        self.assertIn("state=SUCCESSFUL", captured_logs[1])
        self.assertIn(result.id, captured_logs[1])

    def test_failed_logs(self):
        result = wait(test_tasks.failing_task_value_error.enqueue())  # adapted
        captured_logs = worker_log(result.id, 3)  # adapted: as above

        self.assertEqual(len(captured_logs), 3)
        captured_logs = [line for line in captured_logs if "enqueued" not in line]
        self.assertIn("state=RUNNING", captured_logs[0])
        self.assertIn(result.id, captured_logs[0])

        self.assertIn("state=FAILED", captured_logs[1])
        self.assertIn(result.id, captured_logs[1])

    def test_successful_task_no_none_in_logs(self):
        result = wait(test_tasks.noop_task.enqueue())  # adapted

        self.assertEqual(result.status, TaskResultStatus.SUCCESSFUL)

        for log_output in worker_log(result.id, 3):  # adapted: the worker's lines too
            self.assertNotIn("None", log_output)

    def test_takes_context(self):
        result = wait(test_tasks.get_task_id.enqueue())  # adapted

        self.assertEqual(result.return_value, result.id)

    def test_context(self):
        result = wait(test_tasks.test_context.enqueue(1))  # adapted
        self.assertEqual(result.status, TaskResultStatus.SUCCESSFUL)

    def test_validate_on_enqueue(self):
        task_with_custom_queue_name = test_tasks.noop_task.using(queue_name="unknown_queue")

        with override_settings(
            TASKS={"default": {**JOBS, "QUEUES": ["queue-1"]}}  # adapted
        ):
            with self.assertRaisesMessage(
                InvalidTask, "Queue 'unknown_queue' is not valid for backend"
            ):
                task_with_custom_queue_name.enqueue()

    async def test_validate_on_aenqueue(self):
        task_with_custom_queue_name = test_tasks.noop_task.using(queue_name="unknown_queue")

        with override_settings(
            TASKS={"default": {**JOBS, "QUEUES": ["queue-1"]}}  # adapted
        ):
            with self.assertRaisesMessage(
                InvalidTask, "Queue 'unknown_queue' is not valid for backend"
            ):
                await task_with_custom_queue_name.aenqueue()


class ImmediateBackendTransactionTestCase(WorkerTestCase):
    @override_settings(TASKS={"default": JOBS})
    def test_enqueue_commits_with_the_transaction(self):
        # adapted from test_doesnt_wait_until_transaction_commit_by_default: the job and its
        # message commit with the enclosing transaction (the ORM broker), so the worker runs
        # the task after the commit; ImmediateBackend runs it inside, at once.
        with transaction.atomic():
            result = test_tasks.noop_task.enqueue()

            self.assertIsNotNone(result.enqueued_at)

            self.assertEqual(result.status, TaskResultStatus.READY)

        self.assertEqual(wait(result).status, TaskResultStatus.SUCCESSFUL)
