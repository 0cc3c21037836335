// Polling and loading hooks shared by the pages.
import { useCallback, useEffect, useRef, useState } from 'preact/hooks';

/**
 * Calls fn() now and then every ms milliseconds while the page is visible and the component mounted.
 * Calls never overlap (the next waits for the previous to settle); a hidden tab stops the timer and
 * showing it again calls fn() at once. deps restart the cycle. Returns a function that polls now.
 */
export function usePoll(fn, ms, deps = []) {
  const fnRef = useRef(fn);
  fnRef.current = fn;
  const kick = useRef(() => {});
  useEffect(() => {
    let alive = true;
    let timer = null;
    let running = false;
    const schedule = () => {
      clearTimeout(timer);
      timer = null;
      if (alive && ms > 0 && !document.hidden) timer = setTimeout(tick, ms);
    };
    const tick = async () => {
      if (!alive || running) return;
      running = true;
      clearTimeout(timer);
      try {
        await fnRef.current();
      } catch (_) {
        // fn reports its own errors; the poll carries on.
      } finally {
        running = false;
        schedule();
      }
    };
    const onVisibility = () => {
      if (document.hidden) {
        clearTimeout(timer);
        timer = null;
      } else if (!running) {
        tick();
      }
    };
    kick.current = tick;
    document.addEventListener('visibilitychange', onVisibility);
    tick();
    return () => {
      alive = false;
      clearTimeout(timer);
      document.removeEventListener('visibilitychange', onVisibility);
    };
  }, [ms, ...deps]);
  return useCallback(() => kick.current(), []);
}

/**
 * Loads loader() (an async function) whenever deps change, and again every pollMs if given.
 * Returns {data, error, loading, reload}; data keeps the last good answer while a reload runs, and
 * an answer from an older deps set never overwrites a newer one.
 */
export function useFetch(loader, deps = [], pollMs = 0) {
  const [state, setState] = useState({ data: null, error: null, loading: true });
  const generation = useRef(0);
  useEffect(() => {
    generation.current += 1;
    setState((s) => ({ ...s, loading: true }));
  }, deps);
  const run = async () => {
    const mine = generation.current;
    try {
      const data = await loader();
      if (mine === generation.current) setState({ data, error: null, loading: false });
    } catch (error) {
      if (mine === generation.current) setState((s) => ({ data: s.data, error, loading: false }));
    }
  };
  const reload = usePoll(run, pollMs, deps);
  return { ...state, reload };
}
