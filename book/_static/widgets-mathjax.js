/* The ipywidgets HTML manager typesets widget labels through MathJax 2's
   MathJax.Hub.Queue; the site serves MathJax 3, which has no Hub. Forward
   those calls to MathJax 3 once it has started. */
document.addEventListener("DOMContentLoaded", () => {
  const mj = window.MathJax;
  if (!mj || mj.Hub) return;
  mj.Hub = {
    Queue: (...jobs) => {
      const ready = mj.startup ? mj.startup.promise : Promise.resolve();
      ready.then(() => {
        for (const job of jobs) {
          if (Array.isArray(job) && job[0] === "Typeset" && job[2]) {
            mj.typesetPromise([job[2]]).catch(() => {});
          }
        }
      });
    },
  };
});
