// The measurement that chose the shm transport's mechanism (docs/shm.md): a process_vm_writev
// loop (one call per block), the same blocks as one call per 1,024-entry iovec array, the loop on
// two threads, and a memcpy loop between two buffers of one process, into a forked child's
// 64 MiB buffer, at 1,728 B, 64 KiB, 1 MiB and 4 MiB blocks, three rounds each.
//
//   cc -O2 -o target/cma-vs-memcpy scripts/cma-vs-memcpy.c -lpthread && target/cma-vs-memcpy
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <sys/mman.h>
#include <unistd.h>
#include <signal.h>
#include <pthread.h>
#include <time.h>
static size_t TOTAL = 64<<20;
static char *src, *dst, *dst2; static pid_t child; static size_t BLK;
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
typedef struct {size_t from,to;} range;
static void* cma_part(void*a){range*r=a;for(size_t o=r->from;o<r->to;o+=BLK){struct iovec l={src+o,BLK},m={dst+o,BLK};if(process_vm_writev(child,&l,1,&m,1,0)!=(ssize_t)BLK){perror("w");exit(1);}}return 0;}
static void* cma_vec(void*a){range*r=a; size_t n=(r->to-r->from)/BLK; struct iovec *l=malloc(n*sizeof*l),*m=malloc(n*sizeof*m); size_t k=0; for(size_t o=r->from;o<r->to;o+=BLK){l[k].iov_base=src+o;l[k].iov_len=BLK;m[k].iov_base=dst+o;m[k].iov_len=BLK;k++;}
 for(size_t i=0;i<k;i+=1024){size_t c=k-i<1024?k-i:1024; process_vm_writev(child,l+i,c,m+i,c,0);} free(l);free(m);return 0;}
int main(int argc,char**argv){
 src=mmap(0,TOTAL,PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS,-1,0);
 dst=mmap(0,TOTAL,PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS,-1,0);
 dst2=mmap(0,TOTAL,PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS,-1,0);
 memset(src,1,TOTAL);memset(dst,2,TOTAL);memset(dst2,3,TOTAL);
 child=fork(); if(!child){pause();return 0;}
 size_t blks[]={1728,65536,1<<20,4<<20};
 for(int b=0;b<4;b++){BLK=blks[b]; size_t tot=TOTAL/BLK*BLK;
  for(int rep=0;rep<3;rep++){
  double t=now(); range r={0,tot}; cma_part(&r); double c1=tot/(now()-t)/1e9;
  t=now(); cma_vec(&r); double cv=tot/(now()-t)/1e9;
  pthread_t th; range r1={0,tot/2/BLK*BLK},r2={tot/2/BLK*BLK,tot}; t=now(); pthread_create(&th,0,cma_part,&r1); cma_part(&r2); pthread_join(th,0); double c2=tot/(now()-t)/1e9;
  t=now(); for(size_t o=0;o<tot;o+=BLK) memcpy(dst2+o,src+o,BLK); double mc=tot/(now()-t)/1e9;
  printf("blk %zu: cma loop %.2f  cma iov-batched %.2f  cma 2 threads %.2f  memcpy %.2f GB/s\n",BLK,c1,cv,c2,mc);}
 }
 kill(child,9); return 0;}
